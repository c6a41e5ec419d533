"""Int8 / int4 weight-only matmuls against dequantize-then-matmul in fp32, and their error handling."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.errors import UnsupportedQuantizationError
from leanserve.quantization import check_kv_cache_dtype, check_quantization
from leanserve.quantization.int4_pack import block_rows, pack_int4, unpack_int4
from leanserve.quantization.weights import Int4Weight, Int8Weight, quantize_weight

import pytest
import torch

BATCHES = [1, 2, 7, 16, 33, 64]


def _bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |kernel - fp32 reference|: bf16 rounding of the activations and of the output
    (unit roundoff 2**-8 each) -> 2**-7 * (|x| @ |w|.T), plus fp32 summation slack."""
    return 2.0 ** -7 * (x.abs() @ w.abs().T) * 1.05 + 1e-6


@pytest.mark.parametrize("m", BATCHES)
def test_int8_matmul_matches_dequantized_reference(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(192, 256, generator=g) * 0.05
    x = torch.randn(m, 256, generator=g)
    q = Int8Weight.from_float(w)
    deq = q.dequantize()
    assert (deq - w).abs().max() <= (w.abs().amax(1, keepdim=True) / 127 * 0.51 + 1e-6).max()  # round-to-nearest
    ref = x @ deq.T
    y = q.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (m, 192)
    assert torch.all((y - ref).abs() <= _bf16_bound(x, deq))
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", BATCHES)
def test_int4_matmul_matches_dequantized_reference(group_size: int, m: int) -> None:
    g = torch.Generator().manual_seed(group_size * 100 + m)
    w = torch.randn(128, 384, generator=g) * 0.05 + 0.01
    x = torch.randn(m, 384, generator=g)
    q = Int4Weight.from_float(w, group_size)
    deq = q.dequantize()
    # each weight within about half a step (scale) of the original; the bf16 zero point adds a little
    step = (w.view(128, -1, group_size).amax(-1) - w.view(128, -1, group_size).amin(-1)) / 15
    err = (deq - w).view(128, -1, group_size).abs().amax(-1)
    assert torch.all(err <= step * 0.5 + step * 0.1 + 1e-4)
    ref = x @ deq.T
    y = q.matmul(x, torch.ones(128))
    assert y.shape == (m, 128)
    assert torch.all((y - 1 - ref).abs() <= _bf16_bound(x, deq) + 1e-5)


def test_int4_pack_roundtrip_and_layout() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (192, 96), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (192, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # the documented layout: block of B rows, column k, byte j holds rows j (low nibble) and j + B / 2 (high)
    block = block_rows()
    assert block == (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32)
    b = packed.view(192 // block, 96, block // 2)
    assert int(b[1, 5, 7] & 15) == int(codes[block + 7, 5])
    assert int(b[1, 5, 7] >> 4) == int(codes[block + block // 2 + 7, 5])


def test_int4_odd_rows_still_multiply() -> None:
    w = torch.randn(80, 64) * 0.1  # 80 rows: a partial packed block
    q = Int4Weight.from_float(w, 32)
    x = torch.randn(3, 64)
    ref = x @ w.T
    assert torch.allclose(q.matmul(x), ref, atol=0.15 * ref.abs().max().item())
    with pytest.raises(ValueError, match=f"multiple of {block_rows()} rows"):
        q.codes()


def test_unsupported_methods_fail_clearly() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="supported: auto, none, int8, int4"):
        check_quantization("fp8")
    with pytest.raises(UnsupportedQuantizationError, match="group size 16"):
        check_quantization("int4", 16)
    with pytest.raises(UnsupportedQuantizationError, match="kv_cache_dtype 'fp8'"):
        check_kv_cache_dtype("fp8")
    with pytest.raises(UnsupportedQuantizationError, match="does not divide the input width 96"):
        Int4Weight.from_float(torch.randn(64, 96), 64)
    with pytest.raises(UnsupportedQuantizationError):
        quantize_weight(torch.randn(4, 4), "gptq")
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((64, 32), 16))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_rows_are_batch_invariant(kind: str) -> None:
    """A row's result does not depend on how many rows share the call (greedy output alone == batched)."""
    w = torch.randn(256, 192) * 0.05
    q = Int8Weight.from_float(w) if kind == "int8" else Int4Weight.from_float(w, 64)
    x = torch.randn(64, 192)
    full = q.matmul(x)
    for m in (1, 3, 8, 32):
        assert torch.equal(q.matmul(x[:m]), full[:m])
