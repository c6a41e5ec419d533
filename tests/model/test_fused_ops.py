"""The fused RMSNorm, RoPE and SwiGLU kernels (leanserve/kernels/fused_ops.cpp) against the eager torch formulas."""

from __future__ import annotations

import sys

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.model.llama import rms_norm
from leanserve.model.rope import RotaryEmbedding, apply_rope

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native fused ops did not build")


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test here runs on each instruction-set path of the kernels (see tests/conftest.py)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])


@pytest.mark.parametrize("t", [1, 5, 130])
def test_add_rms_norm_matches_torch(t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, y, w = torch.randn(t, 576, generator=g) * 3, torch.randn(t, 576, generator=g), torch.rand(576, generator=g)
    ref_x = x + y
    ref = rms_norm(ref_x, w, 1e-5)
    out = native_ops().add_rms_norm_(x, y, w, 1e-5)
    assert torch.equal(x, ref_x)  # the residual add, in place
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    alone = native_ops().add_rms_norm_(x[-1:].clone(), torch.empty(0), w, 1e-5)
    assert torch.equal(alone, out[-1:])  # each row on its own: bitwise independent of the batch
    with pytest.raises(RuntimeError, match="like x"):
        native_ops().add_rms_norm_(x, y[:, :64].contiguous(), w, 1e-5)


@pytest.mark.parametrize("t", [1, 7, 100])
def test_rope_in_place_matches_apply_rope(t: int) -> None:
    heads, kv_heads, d = 9, 3, 64
    rope = RotaryEmbedding(d, 4096, 100000.0, None)
    pos = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(t))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(t + 1))
    cos, sin = rope.cos_sin(pos, torch.float32)
    q_ref = apply_rope(qkv[:, :heads * d].view(t, heads, d), cos, sin)
    k_ref = apply_rope(qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d), cos, sin)
    v_ref = qkv[:, (heads + kv_heads) * d:].clone()
    native_ops().rope_(qkv, rope.cos[pos], rope.sin[pos], heads, kv_heads, d)
    torch.testing.assert_close(qkv[:, :heads * d].view(t, heads, d), q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d), k_ref,
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_ref)  # values untouched


@pytest.mark.parametrize("t,inter", [(1, 1536), (3, 37), (300, 1536)])
def test_silu_mul_matches_torch(t: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter + t)
    gu = torch.randn(t, 2 * inter, generator=g) * 6
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0])  # sign, over- and underflow
    ref = (torch.nn.functional.silu(gu[:, :inter].double()) * gu[:, inter:].double())
    out = native_ops().silu_mul(gu)
    assert out.shape == (t, inter) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-30)
    assert out[0, 5].item() == 0.0 and out[0, 7].item() == 0.0  # silu(-88), silu(-200): exp underflows to 0
    # each element on its own: a row alone, and an element alone (in a padded tail) give the same bits as in a
    # full vector or in the row's own tail
    assert torch.equal(native_ops().silu_mul(gu[-1:].clone()), out[-1:])
    for j in (0, 9, inter - 1):
        alone = torch.stack([gu[:, j], gu[:, inter + j]], dim=1)
        assert torch.equal(native_ops().silu_mul(alone), out[:, j:j + 1]), j
    with pytest.raises(RuntimeError, match="silu_mul"):
        native_ops().silu_mul(torch.randn(2, 5))
