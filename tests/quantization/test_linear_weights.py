"""The LinearWeight contract every weight class keeps (one ``matmul(x, bias, *, kernel_rows, invariant_rows)``:
x [T, in] -> [T, out] in x's dtype), and the kernel FloatWeight picks per dtype and row count, bitwise."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.quantization import weights as weights_module
from leanserve.quantization.weights import (
    BF16_GEMM_MAX_ROWS,
    INVARIANT_ROWS,
    NO_ROW_LIMIT,
    BlockQuantWeight,
    FloatWeight,
    GroupQuantized,
    Int4Weight,
    Int8Weight,
    numpy_blas_enabled,
)

import pytest
import torch
import torch.nn.functional as F

OUT, IN = 128, 256


def _matrix() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.05


def _group(bits: int) -> GroupQuantized:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8) if bits == 4 else torch.randint(
        -127, 128, (OUT, IN), generator=g, dtype=torch.int8)
    scale = (torch.rand(OUT, IN // 32, generator=g) * 0.01).half().float()
    bias = (torch.rand(OUT, IN // 32, generator=g) * -0.05).half().float() if bits == 4 else None
    return GroupQuantized(codes, scale, bias, 0, bits)


def _weights() -> dict[str, object]:
    ws = {"float32": FloatWeight(_matrix()), "bfloat16": FloatWeight(_matrix().to(torch.bfloat16)),
          "int8 per channel": Int8Weight.from_float(_matrix()),
          "int8 per group": Int8Weight(_group(8).codes, _group(8).scale, 32),
          "int4": Int4Weight.from_float(_matrix(), 64)}
    ext = native_ops()
    if ext is not None:
        ws["block lanes"] = BlockQuantWeight.from_group(_group(4), ext)
        ws["block file"] = BlockQuantWeight.from_group(_group(4), ext, lanes=False)
        ws["block q8 file"] = BlockQuantWeight.from_group(_group(8), ext, lanes=False)
    return ws


WEIGHTS = _weights()


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("t", [1, 2, 9, 50])
def test_every_weight_keeps_the_matmul_contract(name: str, t: int) -> None:
    w = WEIGHTS[name]
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    x = torch.randn(t, IN, generator=torch.Generator().manual_seed(t)).to(dtype)
    bias = torch.linspace(-1, 1, OUT).to(dtype)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    tol = 0.05 * ref.abs().max().item()
    assert w.shape == (OUT, IN) and w.nbytes > 0
    for kw in ({}, {"kernel_rows": min(t, 3)}, {"kernel_rows": 0}, {"invariant_rows": INVARIANT_ROWS}):
        y = w.matmul(x, bias, **kw)
        assert y.shape == (t, OUT) and y.dtype == dtype, kw
        assert (y.double() - ref).abs().max().item() <= tol, kw


@pytest.mark.skipif(not numpy_blas_enabled(), reason="the NumPy BLAS path is off")
def test_float32_rows_run_numpy_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    # every row count on NumPy's BLAS (the torch crossover is measured per machine, and moves under load)
    monkeypatch.setattr(weights_module, "torch_gemm_max_rows", lambda: 0)
    w = _matrix()
    fw = FloatWeight(w)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(2))
    b = torch.randn(OUT, generator=torch.Generator().manual_seed(3))
    wn = w.numpy()
    assert torch.equal(fw.matmul(x[:1]), torch.from_numpy(wn @ x[0].numpy()).unsqueeze(0))  # gemv
    assert torch.equal(fw.matmul(x, b), torch.from_numpy(x.numpy() @ wn.T) + b)  # gemm
    padded = torch.cat([x[:2], torch.zeros(INVARIANT_ROWS - 2, IN)])
    assert torch.equal(fw.matmul(x[:2], invariant_rows=INVARIANT_ROWS),
                       torch.from_numpy(padded.numpy() @ wn.T)[:2])  # gemm on zero-padded rows


@pytest.mark.parametrize("limit", [BF16_GEMM_MAX_ROWS, NO_ROW_LIMIT])
def test_bfloat16_gemm_runs_in_float32_above_the_row_limit(monkeypatch, limit: int) -> None:
    """Either kind of CPU: without a fast bf16 GEMM, products of more than 8 rows run in fp32; with one, in bf16."""
    monkeypatch.setattr(weights_module, "bf16_gemm_max_rows", lambda: limit)
    w = _matrix().to(torch.bfloat16)
    fw = FloatWeight(w)
    b = torch.randn(OUT, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for t in (1, BF16_GEMM_MAX_ROWS, BF16_GEMM_MAX_ROWS + 1, 40):
        x = torch.randn(t, IN, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        expect = (F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16) if t > limit
                  else F.linear(x, w, b))
        assert torch.equal(fw.matmul(x, b), expect), t


def test_bf16_row_limit_is_measured_for_this_cpu() -> None:
    """The measured rule agrees with the CPU's features: oneDNN's bf16 GEMM is fast with AVX512_BF16 or AMX (~5x
    fp32 on the AMD EPYC Zen 5 kind) and emulated, slower than fp32, without them."""
    from leanserve.kernels import cpu_info

    fast = bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["simd"]))
    assert weights_module.bf16_gemm_max_rows() == (NO_ROW_LIMIT if fast else BF16_GEMM_MAX_ROWS)


def test_float_weight_rows_are_an_embedding_lookup() -> None:
    w = _matrix()
    ids = torch.tensor([3, 0, 127, 3])
    assert torch.equal(FloatWeight(w).rows(ids), w[ids]) and FloatWeight(w).nbytes == OUT * IN * 4
