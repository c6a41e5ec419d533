"""The BLAS property batch-invariant mode stands on, and the mode's linear layer."""

from __future__ import annotations

from leanserve.model.attention import PREFILL_MIN_ROWS
from leanserve.quantization.weights import INVARIANT_ROWS, FloatWeight, numpy_blas_enabled

import numpy as np
import pytest
import torch
import torch.nn.functional as F

# (out, in) of the default model's matmuls: fused qkv, o, fused gate/up, down, and the output head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("shape", SHAPES)
def test_blas_gemm_of_fixed_rows_does_not_depend_on_position_or_neighbours(shape):
    """A row's result in a gemm of exactly INVARIANT_ROWS rows is the same wherever it sits and whatever the other
    rows hold (different M may round differently: OpenBLAS's Haswell kernels do at M = 3 vs 7)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    row = rng.standard_normal(shape[1], dtype=np.float32)
    results = []
    for p in range(INVARIANT_ROWS):
        block = rng.standard_normal((INVARIANT_ROWS, shape[1]), dtype=np.float32)
        block[p] = row
        results.append((block @ w.T)[p])
    assert all(np.array_equal(r, results[0]) for r in results)


@pytest.mark.skipif(not numpy_blas_enabled(), reason="the NumPy BLAS path is off")
def test_padded_linear_rows_equal_batched_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    x = torch.randn(40, 576, generator=g)
    fw = FloatWeight(w)
    batched = fw.matmul(x, b, invariant_rows=INVARIANT_ROWS)
    for t in (1, 2, 3, 7, 9, 17, 33):
        alone = fw.matmul(x[:t], b, invariant_rows=INVARIANT_ROWS)
        assert alone.shape == (t, 960) and torch.equal(alone, batched[:t]), t
    tail = fw.matmul(x[5:], b, invariant_rows=INVARIANT_ROWS)  # the same rows at other positions of their chunks
    assert torch.equal(tail, batched[5:])
    # without padding a lone row goes through gemv: same values up to rounding, not bitwise
    torch.testing.assert_close(fw.matmul(x[:1], b), batched[:1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("length", [18, 300])
def test_attention_rows_of_a_chunk_of_min_rows_equal_a_full_prefill(length):
    """The recomputed tail of a prefix-cache hit (>= PREFILL_MIN_ROWS query rows over the gathered cache) gives
    bitwise the rows of a cold causal prefill (a 1-3-row tail does not: torch takes another kernel)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, length, 64, generator=g)
    kv_mem = torch.randn(2, length, 3, 64, generator=g)  # the cache's [tokens, kv_heads, head_dim] layout
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in kv_mem)  # [1, kv_heads, tokens, head_dim] views
    cold = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), is_causal=True, enable_gqa=True)
    pos = torch.arange(length)
    mask = pos[None, :] <= pos[:, None]
    for tail in (PREFILL_MIN_ROWS, PREFILL_MIN_ROWS + 1, 17):
        part = F.scaled_dot_product_attention(q[:, :, -tail:], k, v, attn_mask=mask[-tail:], enable_gqa=True)
        assert torch.equal(part, cold[:, :, -tail:]), tail
