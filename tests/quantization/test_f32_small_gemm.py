"""The float32 few-row product (leanserve/kernels/f32_gemm.cpp) against a float64 reference, its bitwise row
independence, and FloatWeight's use of it."""

from __future__ import annotations

import sys

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.quantization.weights import SMALL_GEMM_MAX_ROWS, FloatWeight

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test here runs on each instruction-set path of the kernels (see tests/conftest.py)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])


# model shapes (fused qkv 576 -> 960, down 1536 -> 576), and widths that are not a multiple of the vector width,
# with row counts that are not a multiple of the kernel's groups of weight rows
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 583), (5, 7), (1, 16)])
def test_matches_float64_and_rows_are_independent(n: int, k: int) -> None:
    ext = native_ops()
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(SMALL_GEMM_MAX_ROWS, k, generator=g)
    ref = x.double() @ w.double().T
    alone = [ext.f32_small_gemm(x[t:t + 1].clone(), w)[0] for t in range(len(x))]
    for rows in range(1, SMALL_GEMM_MAX_ROWS + 1):
        y = ext.f32_small_gemm(x[:rows].clone(), w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        # float32 accumulation over k terms of size ~1: error well under 1e-5 * sqrt(k) * max|ref|
        assert (y.double() - ref[:rows]).abs().max().item() <= 1e-5 * k ** 0.5 * max(1.0, ref.abs().max().item())
        for t in range(rows):  # each row's result is the same bits whatever else is in the product
            assert torch.equal(y[t], alone[t])


def test_refuses_bad_shapes() -> None:
    ext = native_ops()
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ext.f32_small_gemm(torch.randn(9, 16), w)
    with pytest.raises(RuntimeError, match="x \\[T, K\\]"):
        ext.f32_small_gemm(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="float32"):
        ext.f32_small_gemm(torch.randn(2, 16, dtype=torch.float64), w.double())


def test_float_weight_uses_it_up_to_the_row_limit_and_adds_the_bias() -> None:
    ext = native_ops()
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    fw, plain = FloatWeight(w, ext), FloatWeight(w)
    x = torch.randn(SMALL_GEMM_MAX_ROWS + 4, 96, generator=g)
    few = x[:SMALL_GEMM_MAX_ROWS]
    assert torch.equal(fw.matmul(few, b), ext.f32_small_gemm(few, w) + b)
    torch.testing.assert_close(fw.matmul(few, b), plain.matmul(few, b), rtol=1e-5, atol=1e-5)
    # more rows: the BLAS / torch path, as without the kernel
    assert torch.equal(fw.matmul(x), plain.matmul(x))
    # batch-invariant mode keeps its fixed-size chunks
    assert torch.equal(fw.matmul(few, invariant_rows=32), plain.matmul(few, invariant_rows=32))
