"""leanserve's block kernel (leanserve/kernels/block_quant_gemm.cpp) on GGUF Q4_0 / Q4_1 / Q8_0 tensors: the
weights are the file's exactly, and the products match fp32 dequantize-then-matmul far inside bf16 tolerance."""

from __future__ import annotations

from pathlib import Path

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.loader.gguf_quant import read_group_quantized
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.model.llama import linear
from leanserve.quantization.weights import BLOCK_KERNEL_MAX_ROWS, BlockQuantWeight, pack_group_quantized

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.loader.gguf_helpers import write_gguf_file

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native block kernel did not build")

OUT, IN = 160, 576  # 18 blocks per row (an even and an odd tail for the 2-way unrolled loop are both hit below)


def _weight(tmp_path: Path, qtype: QT, out: int = OUT, k: int = IN) -> tuple[BlockQuantWeight, np.ndarray]:
    """A random matrix quantized by gguf-py, written to a GGUF file, read natively and packed for the block kernel;
    with gguf-py's dequantization of the same tensor."""
    rng = np.random.default_rng(int(qtype) * 7 + k)
    w = (rng.standard_normal((out, k)) * 0.05 + rng.uniform(-0.02, 0.02, (out, 1))).astype(np.float32)
    reader = open_gguf(write_gguf_file(tmp_path / "t.gguf", "llama", [("w", gguf.quants.quantize(w, qtype), qtype)]))
    expect = gguf.quants.dequantize(reader.tensors[0].data, qtype).reshape(out, k)
    packed = pack_group_quantized(read_group_quantized(reader.tensors[0]), native_ops())
    assert isinstance(packed, BlockQuantWeight)
    return packed, expect


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_block_weight_keeps_the_file_values(tmp_path: Path, qtype: QT) -> None:
    w, expect = _weight(tmp_path, qtype)
    assert w.shape == (OUT, IN) and w.bits == (8 if qtype == QT.Q8_0 else 4)
    assert np.array_equal(w.dequantize().numpy(), expect)  # bit-exact, like gguf-py
    ids = torch.tensor([5, 0, 159, 5])
    assert np.array_equal(w.rows(ids).numpy(), expect[ids.numpy()])  # embedding lookup
    bits_per_weight = {QT.Q4_0: 5, QT.Q4_1: 5, QT.Q8_0: 8.5}[qtype]  # Q4_0 is held as Q4_1 (one more fp16)
    assert w.nbytes == OUT * IN * bits_per_weight / 8


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1, 64])
def test_block_matmul_matches_fp32_reference(tmp_path: Path, qtype: QT, m: int) -> None:
    w, expect = _weight(tmp_path, qtype)
    x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m)) * 2
    x[0, 7] = 40.0  # an outlier: int16 per block of 32 keeps the rest of its block precise
    ref = x.double() @ torch.from_numpy(expect).double().T
    bias = torch.linspace(-1, 1, OUT)
    y = linear(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (m, OUT)
    # int16 activations: each block's error <= 0.5 * max|x_block| / 32767 * sum|w_block|, plus fp32 sums
    scale = x.abs().view(m, -1, 32).amax(-1).double() / 32767  # [m, blocks]
    wabs = torch.from_numpy(np.abs(expect)).double().view(OUT, -1, 32).sum(-1)  # [out, blocks]
    bound = 0.5 * scale @ wabs.T + 1e-5 * (x.abs().double() @ torch.from_numpy(np.abs(expect)).double().T) + 1e-5
    assert torch.all((y.double() - bias.double() - ref).abs() <= bound)


def test_block_matmul_rows_are_independent(tmp_path: Path) -> None:
    """A row's result is bitwise the same alone and in a batch, on the kernel path and (row_invariant) beyond it."""
    w, _ = _weight(tmp_path, QT.Q4_1)
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS + 8, IN, generator=torch.Generator().manual_seed(3))
    batch = w.matmul(x, row_invariant=True)
    for i in (0, 1, 5, BLOCK_KERNEL_MAX_ROWS + 7):
        assert torch.equal(w.matmul(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(w.matmul(x[:BLOCK_KERNEL_MAX_ROWS])[4:9], w.matmul(x[4:9]))


def test_block_kernel_rejects_bad_shapes(tmp_path: Path) -> None:
    w, _ = _weight(tmp_path, QT.Q4_1)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32|codes must be"):
        w.matmul(torch.randn(2, IN - 32))
