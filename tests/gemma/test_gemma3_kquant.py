"""The Gemma 3 file's quantized matrices on native kernels, against gguf-py's dequantization: Q4_K / Q6_K bytes
(kquant_gemm) and Q5_0 held as exact 8-bit codes (the block kernels), dequantized bit for bit, products within the
bounds of tests/quantization/test_block_quant.py (fp32 sums; plus int16 activations for the block kernels)."""

from __future__ import annotations

from leanserve.kernels import native_ops
from leanserve.loader.gguf_gemma3 import read_q5_0_as_8bit
from leanserve.loader.gguf_tensors import open_gguf, tensor_shape
from leanserve.quantization.kquant import KQuantWeight
from leanserve.quantization.weights import BLOCK_KERNEL_MAX_ROWS, pack_group_quantized

import gguf
import numpy as np
import pytest
import torch

ROWS = [1, 2, 5, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1]


@pytest.fixture(scope="module")
def tensors(gemma_path):
    """Two tensors of each quantized projection type of the file, by type name."""
    out: dict[str, list] = {}
    for t in open_gguf(gemma_path).tensors:
        if t.name.startswith("blk.") and t.tensor_type.name in ("Q4_K", "Q6_K", "Q5_0") and len(
                out.setdefault(t.tensor_type.name, [])) < 2:
            out[t.tensor_type.name].append(t)
    assert {k: len(v) for k, v in out.items()} == {"Q4_K": 2, "Q6_K": 2, "Q5_0": 2}
    return out


def reference(t) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tensor_shape(t))


def kquant(t, ext) -> KQuantWeight:
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    return KQuantWeight(torch.from_numpy(raw.copy()).view(tensor_shape(t)[0], -1), int(t.tensor_type), ext)


def fp32_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    return 1e-5 * (x.abs().double() @ torch.from_numpy(np.abs(w)).double().T) + 1e-5


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kquant_dequantize_and_gemm(tensors, kind):
    ext = native_ops()
    assert ext is not None and hasattr(ext, "kquant_gemm")
    for t in tensors[kind]:
        expect = reference(t)
        w = kquant(t, ext)
        assert w.shape == expect.shape and w.nbytes * 8 / expect.size == (4.5 if kind == "Q4_K" else 6.5625)
        assert np.array_equal(w.dequantize().numpy(), expect)
        assert np.array_equal(kquant(t, None).dequantize().numpy(), expect)  # the gguf-py fallback
        for m in ROWS:
            x = torch.randn(m, expect.shape[1], generator=torch.Generator().manual_seed(m)) * 2
            x[0, 7] = 40.0
            ref = x.double() @ torch.from_numpy(expect).double().T
            bound = fp32_bound(x, expect)
            assert torch.all((w.kernel(x).double() - ref).abs() <= bound)
            y = w.matmul(x, kernel_rows=min(m, 3))  # decode rows on the kernel, the rest dequantized + GEMM
            assert y.shape == (m, expect.shape[0]) and torch.all((y.double() - ref).abs() <= bound)


def test_q5_0_as_exact_8bit_codes(tensors):
    ext = native_ops()
    for t in tensors["Q5_0"]:
        expect = reference(t)
        g = read_q5_0_as_8bit(t)
        assert g.bits == 8 and int(g.codes.min()) >= -16 and int(g.codes.max()) <= 15
        assert np.array_equal(g.dequantize().numpy(), expect)
        w = pack_group_quantized(g, ext)  # the Q8_0 layout: lane kernel
        assert np.array_equal(w.dequantize().numpy(), expect)
        for m in ROWS:
            x = torch.randn(m, expect.shape[1], generator=torch.Generator().manual_seed(m)) * 2
            ref = x.double() @ torch.from_numpy(expect).double().T
            scale = x.abs().view(m, -1, 32).amax(-1).double() / 32767
            wabs = torch.from_numpy(np.abs(expect)).double().view(expect.shape[0], -1, 32).sum(-1)
            bound = 0.5 * scale @ wabs.T + fp32_bound(x, expect)
            assert torch.all((w.matmul(x).double() - ref).abs() <= bound)


def test_bad_kquant_data_is_refused():
    with pytest.raises(ValueError):
        KQuantWeight(torch.zeros(4, 100, dtype=torch.uint8), 12)
    with pytest.raises(ValueError):
        KQuantWeight(torch.zeros(4, 144, dtype=torch.uint8), 3)
