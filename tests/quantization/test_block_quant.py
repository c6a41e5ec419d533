"""leanserve's block and lane kernels (leanserve/kernels/block_quant_gemm.cpp) on GGUF Q4_0 / Q4_1 / Q8_0 tensors:
the weights are the file's exactly, and the products match fp32 dequantize-then-matmul far inside bf16 tolerance."""

from __future__ import annotations

import sys
from pathlib import Path

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.loader.gguf_quant import read_group_quantized
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.quantization.weights import (
    BLOCK_KERNEL_MAX_ROWS,
    INVARIANT_ROWS,
    BlockQuantWeight,
    FloatWeight,
    pack_group_quantized,
)

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.conftest import kernel_isa_paths, use_kernel_isa
from tests.loader.gguf_helpers import write_gguf_file

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native block kernel did not build")


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test here runs on each instruction-set path of the kernels (see tests/conftest.py)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])

# 3 tiles of 64 outputs (lane layout); 18 blocks per row (the block kernel's 2-way unrolled loop: an even count)
OUT, IN = 192, 576


def _weight(tmp_path: Path, qtype: QT, out: int = OUT, k: int = IN, lanes: bool = True,
            ) -> tuple[BlockQuantWeight, np.ndarray]:
    """A random matrix quantized by gguf-py, written to a GGUF file, read natively and packed for the native kernels
    (lane layout, or the file layout when ``lanes`` is False); with gguf-py's dequantization of the same tensor."""
    rng = np.random.default_rng(int(qtype) * 7 + k)
    w = (rng.standard_normal((out, k)) * 0.05 + rng.uniform(-0.02, 0.02, (out, 1))).astype(np.float32)
    reader = open_gguf(write_gguf_file(tmp_path / "t.gguf", "llama", [("w", gguf.quants.quantize(w, qtype), qtype)]))
    expect = gguf.quants.dequantize(reader.tensors[0].data, qtype).reshape(out, k)
    group = read_group_quantized(reader.tensors[0])
    packed = pack_group_quantized(group, native_ops()) if lanes else BlockQuantWeight.from_group(
        group, native_ops(), lanes=False)
    assert isinstance(packed, BlockQuantWeight) and packed.lanes == (lanes and out % 64 == 0)
    return packed, expect


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_block_weight_keeps_the_file_values(tmp_path: Path, qtype: QT) -> None:
    w, expect = _weight(tmp_path, qtype)
    assert w.shape == (OUT, IN) and w.bits == (8 if qtype == QT.Q8_0 else 4)
    assert np.array_equal(w.dequantize().numpy(), expect)  # bit-exact, like gguf-py
    ids = torch.tensor([5, 0, 159, 5])
    assert np.array_equal(w.rows(ids).numpy(), expect[ids.numpy()])  # embedding lookup
    bits_per_weight = {QT.Q4_0: 5, QT.Q4_1: 5, QT.Q8_0: 8.5}[qtype]  # Q4_0 is held as Q4_1 (one more fp16)
    assert w.nbytes == OUT * IN * bits_per_weight / 8  # the lane layout is the file's bytes, permuted
    file, _ = _weight(tmp_path, qtype, lanes=False)
    assert file.nbytes == w.nbytes and np.array_equal(file.dequantize().numpy(), expect)
    assert np.array_equal(file.rows(ids).numpy(), expect[ids.numpy()])


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_lane_row_gather_is_the_file_rows(tmp_path: Path, qtype: QT) -> None:
    """The native lane gather (an embedding lookup) returns exactly the file layout's bytes and scales of the rows
    asked for, in their order; no rows give empty tensors; an id outside the matrix is a RuntimeError."""
    w, _ = _weight(tmp_path, qtype)
    file, _ = _weight(tmp_path, qtype, lanes=False)
    ids = torch.tensor([191, 0, 63, 64, 7, 8, 128, 7])
    codes, d, mn = w.ext.lane_gather_rows(w.codes, w.d, w._mn(), w.bits, ids)
    assert torch.equal(codes, file.codes[ids]) and torch.equal(d, file.d[ids])
    assert torch.equal(mn, file.mn[ids]) if qtype == QT.Q4_1 else mn.numel() == 0
    codes, d, _ = w.ext.lane_gather_rows(w.codes, w.d, w._mn(), w.bits, torch.empty(0, dtype=torch.int64))
    assert codes.shape == (0, file.codes.shape[1]) and d.shape == (0, IN // 32)
    for bad in (OUT, -1):
        with pytest.raises(RuntimeError, match="out of"):
            w.rows(torch.tensor([3, bad]))
    assert torch.equal(w.rows(ids.to(torch.int32)), w.rows(ids))  # any integer dtype
    with pytest.raises(RuntimeError, match="int64"):
        w.rows(torch.tensor([1.0, 2.7]))  # not truncated to ids


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 12, 33, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1, 64])
def test_block_matmul_matches_fp32_reference(tmp_path: Path, qtype: QT, m: int) -> None:
    w, expect = _weight(tmp_path, qtype)
    x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m)) * 2
    x[0, 7] = 40.0  # an outlier: int16 per block of 32 keeps the rest of its block precise
    ref = x.double() @ torch.from_numpy(expect).double().T
    bias = torch.linspace(-1, 1, OUT)
    # int16 activations: each block's error <= 0.5 * max|x_block| / 32767 * sum|w_block|, plus fp32 sums
    scale = x.abs().view(m, -1, 32).amax(-1).double() / 32767  # [m, blocks]
    wabs = torch.from_numpy(np.abs(expect)).double().view(OUT, -1, 32).sum(-1)  # [out, blocks]
    bound = 0.5 * scale @ wabs.T + 1e-5 * (x.abs().double() @ torch.from_numpy(np.abs(expect)).double().T) + 1e-5
    y = w.matmul(x, bias)  # lane layout: the lane kernel at every M
    assert y.dtype == torch.float32 and y.shape == (m, OUT)
    assert torch.all((y.double() - bias.double() - ref).abs() <= bound)
    file, _ = _weight(tmp_path, qtype, lanes=False)
    for kernel in (w.kernel, file.kernel):  # the lane and the block kernel at every M
        assert torch.all((kernel(x).double() - ref).abs() <= bound)


def test_block_matmul_rows_are_independent(tmp_path: Path) -> None:
    """A row's result is bitwise the same alone and in a batch, on the kernel path and (invariant_rows) beyond it."""
    w, _ = _weight(tmp_path, QT.Q4_1)
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS + 8, IN, generator=torch.Generator().manual_seed(3))
    batch = w.matmul(x, invariant_rows=INVARIANT_ROWS)
    for i in (0, 1, 5, BLOCK_KERNEL_MAX_ROWS + 7):
        assert torch.equal(w.matmul(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(w.kernel(x[:12])[4:9], w.kernel(x[4:9]))


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_lane_kernel_rows_are_independent(tmp_path: Path, qtype: QT) -> None:
    """The lane kernel's result for a row does not depend on M or the row's place (tiles of 3 rows, m-blocks)."""
    w, _ = _weight(tmp_path, qtype, out=320)  # 5 tiles of 64 outputs
    assert w.lanes
    x = torch.randn(200, IN, generator=torch.Generator().manual_seed(5))
    batch = w.kernel(x)
    for i in (0, 1, 2, 3, 97, 131, 199):
        assert torch.equal(w.kernel(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(w.kernel(x[50:57]), batch[50:57])


def test_file_layout_when_the_width_is_not_a_multiple_of_64(tmp_path: Path) -> None:
    w, expect = _weight(tmp_path, QT.Q4_1, out=40)
    assert not w.lanes and w.nbytes == 40 * IN * 5 / 8
    x = torch.randn(20, IN, generator=torch.Generator().manual_seed(9))
    ref = x.double() @ torch.from_numpy(expect).double().T
    assert (w.matmul(x).double() - ref).abs().max() < 1e-3  # 20 rows: the block kernel


@pytest.mark.parametrize("lanes", [True, False])
def test_kernels_reject_bad_shapes(tmp_path: Path, lanes: bool) -> None:
    w, _ = _weight(tmp_path, QT.Q4_1, lanes=lanes)
    with pytest.raises(RuntimeError, match="lanes must be|codes must be"):
        w.matmul(torch.randn(2, IN - 32))
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        w.matmul(torch.randn(2, IN - 3))


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_file_layout_kernel_choice_per_row(tmp_path: Path, qtype: QT) -> None:
    """File layout: the block kernel on the leading ``kernel_rows`` decode rows (at most BLOCK_KERNEL_MAX_ROWS),
    dequantize + the FloatWeight GEMM on the rest; with invariant_rows, the kernel on every row. Bitwise."""
    w, _ = _weight(tmp_path, qtype, out=40)
    assert not w.lanes
    w.scratch = torch.empty(50 * IN)  # bigger than the matrix: the dequantization goes there
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS + 10, IN, generator=torch.Generator().manual_seed(11))
    bias = torch.linspace(-1, 1, 40)
    dense = FloatWeight(w.dequantize())
    assert torch.equal(w.matmul(x, bias), dense.matmul(x) + bias)  # kernel_rows None, T > max: all GEMM
    assert torch.equal(w.matmul(x[:5], bias), w.kernel(x[:5]) + bias)  # kernel_rows None, T <= max: kernel
    for n in (0, 3, BLOCK_KERNEL_MAX_ROWS):
        y = w.matmul(x, kernel_rows=n)
        assert torch.equal(y[:n], w.kernel(x[:n])) and torch.equal(y[n:], dense.matmul(x[n:])), n
    assert torch.equal(w.matmul(x, kernel_rows=BLOCK_KERNEL_MAX_ROWS + 1), dense.matmul(x))  # too many: GEMM
    assert torch.equal(w.matmul(x, kernel_rows=3, invariant_rows=INVARIANT_ROWS), w.kernel(x))
    xb = x[:4].to(torch.bfloat16)  # bf16 activations: computed in fp32, returned in bf16
    yb = w.matmul(xb, kernel_rows=4)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, w.kernel(xb.float()).to(torch.bfloat16))


@pytest.mark.parametrize("lanes", [True, False])
def test_zero_rows_give_an_empty_product(tmp_path: Path, lanes: bool) -> None:
    w, _ = _weight(tmp_path, QT.Q4_1, lanes=lanes)
    y = w.kernel(torch.empty(0, IN))
    assert y.shape == (0, OUT) and y.dtype == torch.float32


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_lane_kernel_isa_paths_are_bitwise_equal(tmp_path: Path, qtype: QT) -> None:
    """The AVX-512 single-row tile (two pairs per zmm, the same int32 sums) and the AVX2 path give the same bits,
    for one row (that tile) and a few (the 3-row tiles)."""
    if "avx2" not in kernel_isa_paths():
        pytest.skip("no AVX-512 on this machine: only one ISA path")
    from leanserve.kernels import build_native_ops

    w, _ = _weight(tmp_path, qtype, out=320)
    x = torch.randn(7, IN, generator=torch.Generator().manual_seed(11))
    ys = {}
    for isa in ("native", "avx2"):
        w.ext = build_native_ops(isa)
        ys[isa] = [w.kernel(x[:1]), w.kernel(x)]
    assert torch.equal(ys["native"][0], ys["avx2"][0]) and torch.equal(ys["native"][1], ys["avx2"][1])
    assert torch.equal(ys["native"][0], ys["native"][1][:1])


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_lane_kernel_row_is_bitwise_equal_at_every_m(tmp_path: Path, qtype: QT) -> None:
    """Each row's lane result is bitwise the same for M = 1..12 and 32 (the AVX-512 register tiles of 2-8 rows, the
    one-row tile, 2-thread splits into half tiles of 4 groups and 1-thread whole tiles) as the row alone, and as the
    forced AVX2 path's row alone (where the CPU has AVX-512)."""
    from leanserve.kernels import build_native_ops

    w, _ = _weight(tmp_path, qtype, out=320)  # 5 tiles: an odd count, split into halves on 2 threads
    x = torch.randn(32, IN, generator=torch.Generator().manual_seed(21)) * 3
    alone = torch.cat([w.kernel(x[i:i + 1]) for i in range(32)])
    if "avx2" in kernel_isa_paths():
        avx2 = BlockQuantWeight(w.codes, w.d, w.mn, w.bits, build_native_ops("avx2"), w.scratch, lanes=True)
        assert torch.equal(torch.cat([avx2.kernel(x[i:i + 1]) for i in range(32)]), alone)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            for m in [*range(1, 13), 32]:
                y = w.kernel(x[:m])
                assert torch.equal(y, alone[:m]), (n, m)
            assert torch.equal(w.kernel(x[5:12]), alone[5:12])  # rows at other places in the tiles
    finally:
        torch.set_num_threads(threads)
