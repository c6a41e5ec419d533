"""The native paged decode kernel and the torch path agree with dense causal attention on random caches."""

from __future__ import annotations

import sys

import leanserve  # noqa: F401
from leanserve.kernels import native_ops
from leanserve.model.attention import AttentionMetadata, DecodeGroup, paged_attention

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import kernel_isa_paths, use_kernel_isa

BS, KVH, D = 16, 3, 64


@pytest.fixture(params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """The native kernel's instruction-set paths (see tests/conftest.py)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])
    return request.param


def dense_reference(q, keys, values):
    """q [H, D] against one sequence's keys/values [L, KVH, D] (GQA by repeating KV heads)."""
    group = q.shape[0] // KVH
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]  # [H, D]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [9, 12])
@pytest.mark.parametrize("native", [True, False])
def test_decode_attention_matches_dense(native, heads, cache_dtype, kernel_isa):
    if not native and kernel_isa != "native":
        pytest.skip("the torch path has no instruction-set variants")
    if native and native_ops() is None:
        pytest.fail("the native kernel did not build (a C++ compiler and ninja are installed by `make`)")
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(cache_dtype)
    lens = [1, 17, 100, 333]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:  # scattered, non-contiguous blocks
        nb = -(-n // BS)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, D, generator=gen)
    k_new = torch.randn(len(lens), KVH, D, generator=gen)
    v_new = torch.randn(len(lens), KVH, D, generator=gen)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)])
    mask = None if native else (torch.arange(width * BS)[None] < seq_lens[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, len(lens), table, seq_lens, mask)],
                             decode_kernel=native_ops().paged_decode_attention if native else None)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        keys = k_cache[t].reshape(-1, KVH, D)[:n].float()
        values = v_cache[t].reshape(-1, KVH, D)[:n].float()
        assert torch.equal(keys[-1], k_new[i].to(cache_dtype).float())  # the new token was written to its slot first
        torch.testing.assert_close(out[i], dense_reference(q[i], keys, values), atol=1e-5, rtol=1e-5)
