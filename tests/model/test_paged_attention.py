"""The native paged decode kernel and the torch path agree with dense causal attention on random caches."""

from __future__ import annotations

import shutil
import subprocess
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


def scattered_block_tables(lens, block_size, num_blocks, gen, share=None):
    """Block tables of sequences of ``lens`` tokens on random, scattered blocks of a ``num_blocks`` pool (one
    randperm from ``gen``); ``share`` maps a sequence's index to an earlier one whose blocks it reuses. Returns the
    tables (lists), the zero-padded [N, max_blocks] int64 table and the [N] seq_lens."""
    share = share or {}
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for i, n in enumerate(lens):
        if i in share:
            tables.append(tables[share[i]])
            continue
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens)


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
    tables, table, seq_lens = scattered_block_tables(lens, BS, num_blocks, gen)
    q = torch.randn(len(lens), heads, D, generator=gen)
    k_new = torch.randn(len(lens), KVH, D, generator=gen)
    v_new = torch.randn(len(lens), KVH, D, generator=gen)
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)])
    mask = None if native else (torch.arange(table.shape[1] * BS)[None] < seq_lens[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, len(lens), table, seq_lens, mask)],
                             decode_kernel=native_ops().paged_decode_attention if native else None)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        keys = k_cache[t].reshape(-1, KVH, D)[:n].float()
        values = v_cache[t].reshape(-1, KVH, D)[:n].float()
        assert torch.equal(keys[-1], k_new[i].to(cache_dtype).float())  # the new token was written to its slot first
        torch.testing.assert_close(out[i], dense_reference(q[i], keys, values), atol=1e-5, rtol=1e-5)


def float64_attention(q, k_cache, v_cache, table, seq_lens):
    """Float64 softmax(q k^T / sqrt(D)) v of each sequence (q [N, H, D]) over its cache rows (GQA: query head h
    reads KV head h // G); the independent reference of the native kernel."""
    n_seq, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(n_seq, heads, dim, dtype=torch.float64)
    for i in range(n_seq):
        n = int(seq_lens[i])
        blocks = table[i, :-(-n // block_size)]
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * dim ** -0.5
        out[i] = torch.einsum("ht,thd->hd", torch.softmax(scores, -1), v)
    return out


# every (head size, query heads per KV head) the kernel specializes, and shapes that take the generic loop
SPECIALIZED = [(64, 3), (64, 4), (128, 4), (128, 8)]
GENERIC = [(64, 2), (32, 2)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("dim", "group"), SPECIALIZED + GENERIC)
def test_native_kernel_against_float64(dim, group, cache_dtype, kernel_isa):
    """Each instruction-set path within 2e-6 of float64 attention, on lengths that are not multiples of the block
    size, on sequences split into 2 and 3 partitions of 256 keys (333, 700: the partials merged), and on a
    sequence's 1 + k verification rows (speculative decoding: one block table, consecutive lengths); each sequence's
    output bitwise the same alone as inside the batch (batch invariance)."""
    ops = native_ops()
    if ops is None:
        pytest.fail("the native kernel did not build (a C++ compiler and ninja are installed by `make`)")
    gen = torch.Generator().manual_seed(dim * 10 + group)
    kv_heads, block_size, num_blocks = 2, 16, 96
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    lens = [1, 15, 16, 17, 250, 251, 252, 40, 333, 3, 700]  # 250-252: the 1 + 2 rows of one sequence's verification
    # verification rows 5 and 6 share the first row's (4's) blocks
    _, table, seq_lens = scattered_block_tables(lens, block_size, num_blocks, gen, share={5: 4, 6: 4})
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen)
    out = ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, dim ** -0.5)
    ref = float64_attention(q, k_cache, v_cache, table, seq_lens)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    for i in range(len(lens)):
        alone = ops.paged_decode_attention(q[i:i + 1].clone(), k_cache, v_cache, table[i:i + 1].clone(),
                                           seq_lens[i:i + 1].clone(), dim ** -0.5)
        assert torch.equal(alone[0], out[i]), f"sequence {i}: not bitwise equal alone and in the batch"
    threads = torch.get_num_threads()
    try:  # one thread: other tasks (KV heads per task) and no parallel partitions, the same bits
        torch.set_num_threads(1)
        assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, dim ** -0.5), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [8, 32, 512])
def test_native_kernel_other_block_sizes(block_size, kernel_isa):
    """Blocks of fewer and of more than 16 tokens (the AVX-512 path's score vector) on the model's shape (D 64,
    G 3, float16 cache), against float64; blocks of more than 256 tokens make partitions of one block each."""
    ops = native_ops()
    if ops is None:
        pytest.fail("the native kernel did not build (a C++ compiler and ninja are installed by `make`)")
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 128
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).half()
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).half()
    lens = [1, block_size - 1, block_size + 5, 7 * block_size + 3, 300]
    _, table, seq_lens = scattered_block_tables(lens, block_size, num_blocks, gen)
    q = torch.randn(len(lens), 3 * KVH, D, generator=gen)
    out = ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, D ** -0.5)
    torch.testing.assert_close(out.double(), float64_attention(q, k_cache, v_cache, table, seq_lens), atol=2e-6,
                               rtol=0)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump to read the build")
def test_decode_kernels_keep_their_l2_prefetches(kernel_isa):
    """The SIMD decode kernels prefetch the next blocks into L2 (prefetcht1): once, GCC dropped those prefetches
    without a word (an out-of-line helper without side effects), which changes no result, only the speed over
    scattered blocks (README, "CPU kernels"), so only the build itself can show it. Each of the 8 SIMD
    instantiations (4 head shapes x 2 cache dtypes) keeps its K and V prefetch."""
    ops = native_ops()
    if ops is None:
        pytest.fail("the native kernel did not build (a C++ compiler and ninja are installed by `make`)")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ops.__file__], capture_output=True, text=True,
                          check=True).stdout
    assert code.count("prefetcht1") >= 2 * 8
