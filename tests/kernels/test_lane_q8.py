"""The int8 prefill path of 4-bit lane-layout weights (leanserve/kernels/lane_q8_gemm.cpp, ``--prefill-gemm int8``):
the kernel computes its stated scheme (int8 activations per block of 32, exact int32 sums, fp32 scaling) to fp32
rounding, stays within the int8 rounding bound of the exact product, gives each row a result bitwise independent
of the other rows and bitwise equal on every instruction-set path, writes into ``out``, refuses what it cannot
take, and BlockQuantWeight.matmul sends exactly its prefill rows there."""

from __future__ import annotations

import sys

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import build_native_ops, native_ops
from leanserve.quantization.prefill_gemm import Int8Prefill, configure_prefill_gemm, resolve_prefill_gemm
from leanserve.quantization.weights import BlockQuantWeight, GroupQuantized

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")

OUT, IN = 192, 576  # 3 tiles of 64 outputs, 18 blocks


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test runs on each instruction-set path (avx2: vpmaddubsw; native here: vpdpbusd)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])


def _group(kind: str, out: int = OUT, k: int = IN, seed: int = 0) -> GroupQuantized:
    """Random GGUF-kind codes and fp16-exact scales: Q4_1 (offsets), Q4_0 (offset 8) or Q8_0."""
    g = torch.Generator().manual_seed(seed * 7 + len(kind) * 1000 + out)
    scale = (torch.rand(out, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        return GroupQuantized(torch.randint(-128, 128, (out, k), generator=g, dtype=torch.int8), scale, None, 0, 8)
    codes = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    if kind == "Q4_0":
        return GroupQuantized(codes, scale, None, 8, 4)
    bias = (torch.rand(out, k // 32, generator=g) * -0.1).half().float()
    return GroupQuantized(codes, scale, bias, 0, 4)


def _weight(kind: str, out: int = OUT, k: int = IN, seed: int = 0) -> BlockQuantWeight:
    w = BlockQuantWeight.from_group(_group(kind, out, k, seed), native_ops())
    assert w.lanes
    return w


def _q8(w: BlockQuantWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return native_ops().lane_q8_gemm(x, w.codes, w.d, w.mn, out)


def _scheme(x: torch.Tensor, g: GroupQuantized) -> torch.Tensor:
    """The stated scheme in float64, written independently of the kernel: per row and block of 32, dx = max|x| /
    127, xq = round-half-even(x / dx) (x * (1 / dx) in fp32, as the kernel rounds), y = sum_b d dx (q . xq) + mn
    dx sum(xq): the dequantized weight times the quantized activations."""
    m, k = x.shape
    nb = k // 32
    xb = x.view(m, nb, 32)
    dx = xb.abs().amax(-1) / 127.0  # fp32, as the kernel
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127).double()
    q = g.codes.view(-1, nb, 32).double()
    mn = (g.bias if g.bias is not None else torch.zeros_like(g.scale)) - g.offset * g.scale
    dots = torch.einsum("mbk,nbk->mnb", xq, q)
    xs = dx.double() * xq.sum(-1)
    return (dots * g.scale.double()[None] * dx.double()[:, None, :]).sum(-1) + xs @ mn.double().T


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 100, 193])
def test_kernel_computes_its_scheme_within_fp32_rounding(kind: str, m: int) -> None:
    g = _group(kind, seed=m)
    w = BlockQuantWeight.from_group(g, native_ops())
    x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m))
    y = _q8(w, x)
    ref = _scheme(x, g)
    assert y.shape == (m, OUT) and y.dtype == torch.float32
    # fp32 accumulation of 18 scaled block sums: a few ulps of the largest output (int8 rounding is not in here)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), (y.double() - ref).abs().max()


def test_kernel_within_int8_rounding_of_the_exact_product() -> None:
    """Against the float64 product of x and the dequantized weight: the int8 rounding of each activation is at
    most max|x| / 254 of its block, so |error| <= sum over k of |w[n, k]| * that half-step."""
    g = _group("Q4_1")
    w = BlockQuantWeight.from_group(g, native_ops())
    x = torch.randn(40, IN, generator=torch.Generator().manual_seed(1))
    x[5] *= 1e-3  # scale does not matter: the bound is relative to each block
    wd = g.dequantize().double()
    exact = x.double() @ wd.T
    half_step = (x.view(40, -1, 32).abs().amax(-1) / 254).double().repeat_interleave(32, dim=1)  # [M, K]
    bound = half_step @ wd.abs().T + 1e-5 * exact.abs().max()
    err = (_q8(w, x).double() - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 1e-4 * exact.abs().max()  # it is an int8 scheme: coarser than the int16 lane kernel
    lane_err = (w.kernel(x).double() - exact).abs().max()
    assert lane_err < err.max() / 10


def test_rows_are_independent_of_the_other_rows() -> None:
    """A row's result is bitwise the same alone, in any register tile (1-8 rows) and in any m-block."""
    w = _weight("Q4_1", out=320)  # 5 tiles: tiles split in halves between 2 threads
    x = torch.randn(300, IN, generator=torch.Generator().manual_seed(2))
    full = _q8(w, x)
    for start, stop in [(0, 1), (7, 8), (299, 300), (3, 12), (100, 197), (0, 96), (5, 300)]:
        assert torch.equal(_q8(w, x[start:stop].contiguous()), full[start:stop]), (start, stop)


def test_every_instruction_set_path_gives_the_same_bits() -> None:
    if "avx2" not in kernel_isa_paths():
        pytest.skip("one instruction-set path on this machine")
    w = _weight("Q4_1")
    x = torch.randn(37, IN, generator=torch.Generator().manual_seed(3))
    ys = [build_native_ops(isa).lane_q8_gemm(x, w.codes, w.d, w.mn) for isa in ("native", "avx2")]
    assert torch.equal(ys[0], ys[1])


def test_out_is_written_and_bad_input_is_refused() -> None:
    w = _weight("Q4_1")
    x = torch.randn(10, IN)
    y = torch.full((14, OUT), 7.0)
    got = _q8(w, x, y[2:12])
    assert got.data_ptr() == y[2:12].data_ptr() and torch.equal(y[2:12], _q8(w, x))
    assert (y[:2] == 7).all() and (y[12:] == 7).all()
    assert _q8(w, torch.empty(0, IN)).shape == (0, OUT)
    q8w = _weight("Q8_0")
    with pytest.raises(RuntimeError, match="4-bit lane layout"):
        native_ops().lane_q8_gemm(x, q8w.codes, q8w.d, q8w._mn())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_ops().lane_q8_gemm(torch.randn(2, 40), w.codes, w.d, w.mn)
    with pytest.raises(RuntimeError, match="lanes must be"):
        native_ops().lane_q8_gemm(torch.randn(2, 64), w.codes, w.d, w.mn)  # K of another matrix
    with pytest.raises(RuntimeError, match="out must be"):
        _q8(w, x, torch.empty(10, OUT + 1))


def test_matmul_sends_prefill_rows_to_int8_and_decode_rows_to_the_lane_kernel() -> None:
    ext = native_ops()
    w4, w8 = _weight("Q4_1"), _weight("Q8_0", out=128)
    x = torch.randn(20, IN, generator=torch.Generator().manual_seed(4))
    w4.prefill = w8.prefill = Int8Prefill(ext)
    y = w4.matmul(x, kernel_rows=3)
    assert torch.equal(y[:3], w4.kernel(x[:3])) and torch.equal(y[3:], _q8(w4, x[3:]))
    assert not torch.equal(y[3:], w4.kernel(x[3:]))  # a different scheme: not the lane kernel's bits
    assert torch.equal(w4.matmul(x), w4.kernel(x))  # kernel_rows None (all rows alike): the lane kernel
    assert torch.equal(w8.matmul(x, kernel_rows=3), w8.kernel(x))  # 8-bit weights keep the lane kernel


def test_int8_mode_resolves_and_configures() -> None:
    ext = native_ops()
    isa = ext.lane_q8_gemm_isa()
    assert isa in ("avx512_vnni", "avx_vnni", "avx2")
    assert resolve_prefill_gemm("int8", ext) == "int8" and resolve_prefill_gemm("int8", None) == "lane"
    want_auto = "bf16" if ext.bf16_gemm_simd() else "int8" if isa in ("avx2", "avx_vnni") else "lane"
    assert resolve_prefill_gemm("auto", ext) == want_auto

    class Layer:
        def __init__(self) -> None:
            self.qkv, self.down = _weight("Q4_1"), _weight("Q8_0", out=128)

    class Model:
        layers = [Layer(), Layer()]

    m = Model()
    assert configure_prefill_gemm(m, "int8") == "int8"
    shared = m.layers[0].qkv.prefill
    assert isinstance(shared, Int8Prefill) and shared.mode == "int8"
    assert all(t.prefill is shared for layer in m.layers for t in (layer.qkv, layer.down))
    assert configure_prefill_gemm(m, "lane") == "lane" and m.layers[1].qkv.prefill is None


def test_int8_is_not_claimed_where_it_does_not_run(caplog) -> None:
    """No lane-layout weights (float or torch-quantized projections): ``lane``, with a warning that an explicit
    mode is not used (and none for ``auto`` or ``lane``, which ask for nothing); batch-invariant mode (every row on
    the lane kernel): ``lane``, with a warning that ``--prefill-gemm`` is not used."""
    from leanserve import LLM
    from leanserve.loader import load_model

    class Model:
        layers = [type("Layer", (), {})()]

    with caplog.at_level("WARNING"):
        assert configure_prefill_gemm(Model(), "auto") == configure_prefill_gemm(Model(), "lane") == "lane"
    assert not caplog.records
    for mode in ("int8", "bf16"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert configure_prefill_gemm(Model(), mode) == "lane"
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"--prefill-gemm {mode} is not used"]
    caplog.clear()
    llm = LLM(loaded=load_model(None, quantization="auto"), kv_cache_memory=16 << 20, prefill_gemm="int8",
              batch_invariant=True)
    assert llm.engine.prefill_gemm == "lane" and "prefill GEMM lane" in llm.engine.describe()
    assert any("--prefill-gemm int8 is not used" in r.getMessage() for r in caplog.records)
