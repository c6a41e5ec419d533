"""The bf16 prefill path of lane-layout GGUF weights (leanserve/kernels/lane_dequant.cpp,
leanserve/quantization/prefill_gemm.py): the bf16 copy is block_dequantize's fp32 weight rounded to bf16, the
products are within their stated bounds of the exact product, each row's result is bitwise independent of the
other rows, and BlockQuantWeight.matmul sends exactly its prefill rows there."""

from __future__ import annotations

import sys
import time

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import kernels
from leanserve.config import EngineConfig
from leanserve.errors import EnvironmentSettingError, InvalidParameterError
from leanserve.kernels import l3_cache_bytes, native_ops, use_streaming_prefetch
from leanserve.quantization.prefill_gemm import (
    BF16_GEMM_ENV,
    Bf16Prefill,
    configure_prefill_gemm,
    resolve_bf16_engine,
    resolve_prefill_gemm,
)
from leanserve.quantization.weights import INVARIANT_ROWS, BlockQuantWeight, GroupQuantized

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")

OUT, IN = 192, 576  # 3 tiles of 64 outputs, 18 blocks
E = torch.empty(0, dtype=torch.bfloat16)


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test runs on each instruction-set path (the avx2 one has no AVX512_BF16: the scalar loops)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])


def _weight(kind: str, out: int = OUT, k: int = IN) -> BlockQuantWeight:
    """A random lane-layout matrix of GGUF kind Q4_1, Q4_0 or Q8_0 (fp16-exact scales and offsets)."""
    g = torch.Generator().manual_seed(len(kind) * 1000 + out)
    scale = (torch.rand(out, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        gq = GroupQuantized(torch.randint(-128, 128, (out, k), generator=g, dtype=torch.int8), scale, None, 0, 8)
    elif kind == "Q4_0":
        gq = GroupQuantized(torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8), scale, None, 8, 4)
    else:
        bias = (torch.rand(out, k // 32, generator=g) * -0.1).half().float()
        gq = GroupQuantized(torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8), scale, bias, 0, 4)
    w = BlockQuantWeight.from_group(gq, native_ops())
    assert w.lanes
    return w


def _unpack(buf: torch.Tensor, out: int, k: int) -> torch.Tensor:
    """The pair-packed [out / 16, k / 2, 16, 2] buffer as [out, k]."""
    return buf[:out * k].view(out // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(out, k)


def _split(w: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    hi = torch.empty(OUT * IN + 7, dtype=torch.bfloat16)  # a buffer larger than the matrix, as the model's shared one
    lo = torch.empty_like(hi)
    native_ops().lane_dequant_bf16(w.codes, w.d, w._mn(), w.bits, hi, lo)
    return hi, lo


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_bf16_copy_is_the_fp32_dequantization_rounded(kind: str) -> None:
    w = _weight(kind)
    ref = w.dequantize()  # block_dequantize: gguf-py's values
    hi, lo = _split(w)
    assert torch.equal(_unpack(hi, OUT, IN), ref.to(torch.bfloat16))  # bitwise
    assert torch.equal(_unpack(lo, OUT, IN), (ref - ref.to(torch.bfloat16).float()).to(torch.bfloat16))
    hi2 = torch.empty_like(hi)
    native_ops().lane_dequant_bf16(w.codes, w.d, w._mn(), w.bits, hi2, E)  # no lo: the same hi
    assert torch.equal(hi2[:OUT * IN], hi[:OUT * IN])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_bf16_products_within_their_bounds(kind: str) -> None:
    w = _weight(kind)
    wf = w.dequantize().double()
    hi, lo = _split(w)
    x = torch.randn(37, IN, generator=torch.Generator().manual_seed(3)) * 2
    x[0, 5] = 40.0
    exact = x.double() @ wf.T
    mag = x.double().abs() @ wf.abs().T  # |x| @ |w|.T
    fp32_sum = IN * 2.0**-24  # fp32 accumulation over K terms
    y = native_ops().bf16_gemm(x, hi, E, OUT)
    assert y.dtype == torch.float32 and y.shape == (37, OUT)
    # bf16 rounds x and w (2**-9 each, relative) and sums exactly-formed products in fp32
    assert ((y.double() - exact).abs() <= (2 * 2.0**-9 + 2.0**-18 + fp32_sum) * mag).all()
    y3 = native_ops().bf16_gemm(x, hi, lo, OUT)
    # bf16x3: the residues are rounded (2**-18 each) and xl * wl (<= 2**-18) is dropped
    err3 = (y3.double() - exact).abs()
    assert (err3 <= (3 * 2.0**-18 + 3 * fp32_sum) * mag).all()
    assert err3.max() < (y.double() - exact).abs().max() / 20  # much closer than bf16


@pytest.mark.parametrize("x3", [False, True])
def test_bf16_rows_do_not_depend_on_the_other_rows(x3: bool) -> None:
    w = _weight("Q4_1")
    hi, lo = _split(w)
    lo = lo if x3 else E
    x = torch.randn(300, IN, generator=torch.Generator().manual_seed(5))
    full = native_ops().bf16_gemm(x, hi, lo, OUT)
    for m in [*range(1, 26), 95, 96, 97, 191, 250]:
        assert torch.equal(native_ops().bf16_gemm(x[:m], hi, lo, OUT), full[:m]), m  # the first rows
        assert torch.equal(native_ops().bf16_gemm(x[300 - m:], hi, lo, OUT), full[300 - m:]), m  # rows shifted


def test_matmul_sends_prefill_rows_to_bf16_and_decode_rows_to_the_lane_kernel() -> None:
    w = _weight("Q4_1")
    x = torch.randn(20, IN, generator=torch.Generator().manual_seed(9))
    bias = torch.linspace(-1, 1, OUT)
    lane = w.kernel(x)
    hi = torch.empty(OUT * IN, dtype=torch.bfloat16)
    w.prefill = Bf16Prefill(native_ops(), hi, E)
    bf16 = w.prefill.matmul(w, x)
    for n in (0, 1, 7, 19):
        y = w.matmul(x, bias, kernel_rows=n)
        assert torch.equal(y[:n], lane[:n] + bias) and torch.equal(y[n:], bf16[n:] + bias), n
    assert torch.equal(w.matmul(x, kernel_rows=20), lane)  # decode rows only
    assert torch.equal(w.matmul(x), lane)  # kernel_rows None (the output head): all rows alike, lane kernel
    assert torch.equal(w.matmul(x, kernel_rows=3, invariant_rows=INVARIANT_ROWS), lane)  # batch-invariant mode


def test_prefill_gemm_modes_resolve_and_bad_ones_are_rejected() -> None:
    ext = native_ops()
    simd = ext.bf16_gemm_simd()
    assert resolve_prefill_gemm("auto", ext) == ("bf16" if simd else "int8")  # int8: the AVX2 build
    # an explicit bf16 mode without AVX512_BF16 (the forced AVX2 build) runs lane: the scalar loops are ~40x slower
    assert resolve_prefill_gemm("bf16x3", ext) == ("bf16x3" if simd else "lane")
    assert resolve_prefill_gemm("bf16", None) == "lane" and resolve_prefill_gemm("lane", ext) == "lane"
    with pytest.raises(InvalidParameterError):
        resolve_prefill_gemm("fp8", ext)
    with pytest.raises(InvalidParameterError) as e:
        EngineConfig(prefill_gemm="fp8")
    assert e.value.param == "prefill_gemm"

    class Layer:
        def __init__(self) -> None:
            self.qkv, self.down = _weight("Q4_1"), _weight("Q8_0", out=128)

    class Model:
        layers = [Layer(), Layer()]

    m = Model()
    if not simd:
        assert configure_prefill_gemm(m, "bf16x3") == "lane" and m.layers[0].qkv.prefill is None
        return
    assert configure_prefill_gemm(m, "bf16x3") == "bf16x3"
    shared = m.layers[0].qkv.prefill
    assert all(t.prefill is shared for layer in m.layers for t in (layer.qkv, layer.down))
    assert shared.mode == "bf16x3" and shared.hi.numel() == OUT * IN == shared.lo.numel()  # sized for the largest
    assert configure_prefill_gemm(m, "lane") == "lane" and m.layers[1].down.prefill is None


def _amx_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """TDPBF16PS's sums as the Intel SDM's pseudocode states them, in float32: per output, for each pair of k in
    order, the even element's product added, then the odd one's (bf16 x bf16 products are exact in float32)."""
    xb, wb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xb[:, k:k + 1] * wb[:, k]
    return acc


def test_amx_tile_program_is_the_pseudocode_and_rows_are_independent() -> None:
    """The AMX engine's tile program, run on the emulated tiles (this test needs no AMX): each output is the
    pseudocode's sequence of fp32 sums (bitwise), for row counts around the 32-row block, and bf16x3 stays within
    its bound; the hardware engine runs the same program (next test)."""
    ext = native_ops()
    w = _weight("Q4_1")
    hi, lo = _split(w)
    x = torch.randn(70, IN, generator=torch.Generator().manual_seed(11))
    ref = _amx_reference(x, _unpack(hi, OUT, IN).float())
    full = ext.bf16_gemm(x, hi, E, OUT, "amx_emulated")
    assert torch.equal(full, ref)
    for m in (1, 15, 16, 17, 31, 33, 64):
        assert torch.equal(ext.bf16_gemm(x[70 - m:], hi, E, OUT, "amx_emulated"), full[70 - m:]), m
    # the engines sum the same products in other orders: equal within fp32 accumulation
    mag = x.double().abs() @ _unpack(hi, OUT, IN).double().abs().T
    assert ((ext.bf16_gemm(x, hi, E, OUT).double() - full.double()).abs() <= 2 * IN * 2.0**-24 * mag).all()
    exact = x.double() @ w.dequantize().double().T
    y3 = ext.bf16_gemm(x, hi, lo, OUT, "amx_emulated")
    assert ((y3.double() - exact).abs() <= (3 * 2.0**-18 + 3 * IN * 2.0**-24) * mag).all()
    for m in (1, 16, 17):
        assert torch.equal(ext.bf16_gemm(x[:m], hi, lo, OUT, "amx_emulated"), y3[:m]), m
    with pytest.raises(RuntimeError, match="engine must be"):
        ext.bf16_gemm(x, hi, E, OUT, "amx2")


@pytest.mark.skipif(native_ops() is None or native_ops().amx_bf16_status() != "ready",
                    reason="this process cannot run AMX tiles (no AMX-BF16, or no tile permission)")
def test_amx_hardware_equals_its_emulation() -> None:
    ext = native_ops()
    if ext.amx_bf16_status() != "ready":  # the forced AVX2 build has no AMX engine
        pytest.skip(f"AMX engine: {ext.amx_bf16_status()}")
    w = _weight("Q8_0")
    hi, lo = _split(w)
    x = torch.randn(130, IN, generator=torch.Generator().manual_seed(13))
    for low in (E, lo):
        hw, emu = ext.bf16_gemm(x, hi, low, OUT, "amx"), ext.bf16_gemm(x, hi, low, OUT, "amx_emulated")
        mag = x.double().abs() @ _unpack(hi, OUT, IN).double().abs().T
        assert ((hw.double() - emu.double()).abs() <= 2 * IN * 2.0**-24 * mag).all()
        for m in (1, 17, 33):
            assert torch.equal(ext.bf16_gemm(x[:m], hi, low, OUT, "amx"), hw[:m]), m


def test_bf16_engine_is_forced_by_env_or_measured(monkeypatch) -> None:
    ext = native_ops()
    w = _weight("Q4_1")
    hi, lo = _split(w)
    status = ext.amx_bf16_status()
    assert status in ("ready", "build", "cpu", "os", "permission")
    monkeypatch.setenv(BF16_GEMM_ENV, "avx512_bf16")
    assert resolve_bf16_engine(ext, w, hi, E) == "avx512_bf16"
    monkeypatch.setenv(BF16_GEMM_ENV, "tiles")
    with pytest.raises(EnvironmentSettingError, match=BF16_GEMM_ENV) as bad:
        resolve_bf16_engine(ext, w, hi, E)
    assert bad.value.variable == BF16_GEMM_ENV

    class Model:
        layers = [type("Layer", (), {})()]

    Model.layers[0].qkv = w
    with pytest.raises(EnvironmentSettingError):  # checked whatever the mode, lane included
        configure_prefill_gemm(Model(), "lane")
    monkeypatch.setenv(BF16_GEMM_ENV, "amx")
    if status == "ready":
        assert resolve_bf16_engine(ext, w, hi, E) == "amx"
    else:
        with pytest.raises(EnvironmentSettingError, match=status):
            resolve_bf16_engine(ext, w, hi, E)
    monkeypatch.delenv(BF16_GEMM_ENV)

    class Tiles:  # a machine whose AMX is ready: the engines are timed, the faster wins
        def __init__(self, slow: str) -> None:
            self.slow, self.calls, self.wrong = slow, [], None

        def __getattr__(self, name):
            return getattr(ext, name)

        def amx_bf16_status(self) -> str:
            return "ready"

        def bf16_gemm(self, x, hi, lo, n, engine):
            self.calls.append((x.shape[0], engine))
            if engine == self.slow:
                time.sleep(0.01)
            y = ext.bf16_gemm(x, hi, lo, n)
            return y * 1.001 if engine == self.wrong else y

    for slow, faster in (("avx512_bf16", "amx"), ("amx", "avx512_bf16")):
        fake = Tiles(slow)
        assert resolve_bf16_engine(fake, w, hi, E, rows=40) == faster
        assert set(fake.calls) == {(40, "avx512_bf16"), (40, "amx")}
    fake = Tiles("avx512_bf16")
    fake.wrong = "amx"  # faster but wrong (a broken tile path): not served
    assert resolve_bf16_engine(fake, w, hi, E, rows=40) == "avx512_bf16"
    if status != "ready":  # auto without AMX: the AVX512_BF16 engine, nothing timed
        assert resolve_bf16_engine(ext, w, hi, E) == "avx512_bf16"


def test_a_forced_bf16_engine_that_no_mode_uses_is_named_in_a_warning(monkeypatch, caplog) -> None:
    """``$LEANSERVE_BF16_GEMM`` set to an engine while the prefill rows resolve to ``lane`` or ``int8`` (asked, or
    a build without AVX512_BF16): a warning says the setting is not used; under a bf16 mode that runs, none."""
    ext = native_ops()

    class Model:
        layers = [type("Layer", (), {})()]

    Model.layers[0].qkv = _weight("Q4_1")
    monkeypatch.setenv(BF16_GEMM_ENV, "avx512_bf16")
    for mode in ("lane", "int8", "bf16"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="leanserve.quantization.prefill_gemm"):
            resolved = configure_prefill_gemm(Model(), mode)
        unused = [r for r in caplog.records if r.getMessage().startswith(f"${BF16_GEMM_ENV}=avx512_bf16 is not "
                                                                         f"used: prefill rows run the {resolved}")]
        assert len(unused) == (resolved not in ("bf16", "bf16x3")), (mode, resolved)
        assert resolved == (mode if mode != "bf16" or ext.bf16_gemm_simd() else "lane")

    class Plain:  # no lane-layout weights (--quantization int8 or none): no bf16 GEMM at all
        layers = [type("Layer", (), {})()]

    caplog.clear()
    with caplog.at_level("WARNING", logger="leanserve.quantization.prefill_gemm"):
        assert configure_prefill_gemm(Plain(), "auto") == "lane"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"${BF16_GEMM_ENV}=avx512_bf16 is not used"]


def test_kernels_write_into_a_given_output_or_refuse_a_wrong_one() -> None:
    ext = native_ops()
    w = _weight("Q4_1")
    hi, _ = _split(w)
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(17))
    y = torch.full((12, OUT), 7.0)
    ext.lane_quant_gemm(x[:4], w.codes, w.d, w._mn(), w.bits, y[1:5])
    ext.bf16_gemm(x[4:], hi, E, OUT, "avx512_bf16", y[5:10])
    assert torch.equal(y[1:5], w.kernel(x[:4])) and torch.equal(y[5:10], ext.bf16_gemm(x[4:], hi, E, OUT))
    assert (y[0] == 7).all() and (y[10:] == 7).all()  # nothing outside the given rows
    for bad in (torch.empty(4, OUT + 64), torch.empty(4, OUT, dtype=torch.float64), torch.empty(OUT, 4).T):
        with pytest.raises(RuntimeError, match="out must be"):
            ext.lane_quant_gemm(x[:4], w.codes, w.d, w._mn(), w.bits, bad)
        with pytest.raises(RuntimeError, match="out must be"):
            ext.bf16_gemm(x[:4], hi, E, OUT, "avx512_bf16", bad)


def test_prefetch_hint_changes_no_result_and_follows_the_cache_size() -> None:
    """The lane kernels' prefetch hint (t0 or nta) only moves data between caches: every row count gives the same
    bits under both. The rule: nta once a model's weights exceed the L3 cache, sticky for the process (the rule sets
    the process's build, leanserve.kernels.native_ops(), whatever path this test's ext is; an earlier test that
    loaded the default model may have left it nta)."""
    ext = native_ops()
    process_ext = kernels.native_ops()
    before, process_before = ext.lane_prefetch_hint(), process_ext.lane_prefetch_hint()
    try:
        for kind in ("Q4_1", "Q8_0"):
            w = _weight(kind, out=320, k=IN)
            for rows in (1, 2, 3, 8, 33):
                x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
                ext.set_lane_prefetch_hint("t0")
                y0 = w.kernel(x)
                ext.set_lane_prefetch_hint("nta")
                assert ext.lane_prefetch_hint() == "nta"
                assert torch.equal(w.kernel(x), y0), (kind, rows)
        with pytest.raises(RuntimeError, match="t0 or nta"):
            ext.set_lane_prefetch_hint("t1")
        process_ext.set_lane_prefetch_hint("t0")
        assert use_streaming_prefetch(96 << 20, l3_bytes=480 << 20) == "t0"  # fits: stays cached, t0
        assert use_streaming_prefetch(96 << 20, l3_bytes=32 << 20) == "nta"  # streams through a 32 MiB L3
        assert use_streaming_prefetch(1 << 20, l3_bytes=32 << 20) == "nta"  # sticky: a small draft model after it
        l3 = l3_cache_bytes()
        assert l3 is None or l3 >= 1 << 20
    finally:
        ext.set_lane_prefetch_hint(before)
        process_ext.set_lane_prefetch_hint(process_before)
