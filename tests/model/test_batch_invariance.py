"""The BLAS property batch-invariant mode stands on, and the mode's linear layer."""

from __future__ import annotations

from leanserve.model.llama import _INVARIANT_MIN_ROWS, linear, numpy_blas_enabled

import numpy as np
import pytest
import torch

# (out, in) of the default model's matmuls: fused qkv, o, fused gate/up, down, and the output head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("shape", SHAPES)
def test_blas_gemm_rows_do_not_depend_on_the_number_of_rows(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((200, shape[1]), dtype=np.float32)
    ref = x[:_INVARIANT_MIN_ROWS] @ w.T
    for m in (_INVARIANT_MIN_ROWS + 1, 7, 16, 33, 64, 200):
        assert np.array_equal((x[:m] @ w.T)[:_INVARIANT_MIN_ROWS], ref), m


@pytest.mark.skipif(not numpy_blas_enabled(), reason="the NumPy BLAS path is off")
def test_padded_linear_rows_equal_batched_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    x = torch.randn(40, 576, generator=g)
    batched = linear(x, w, b, min_rows=_INVARIANT_MIN_ROWS)
    for t in (1, 2):
        alone = linear(x[:t], w, b, min_rows=_INVARIANT_MIN_ROWS)
        assert alone.shape == (t, 960) and torch.equal(alone, batched[:t])
    # without padding a lone row goes through gemv: same values up to rounding, not bitwise
    torch.testing.assert_close(linear(x[:1], w, b), batched[:1], rtol=1e-5, atol=1e-4)
