"""The kernel of prefill rows for lane-layout GGUF weights (``--prefill-gemm``): the lane kernel, bf16, or int8.

A lane-layout :class:`~leanserve.quantization.weights.BlockQuantWeight` runs its decode rows (the leading
``kernel_rows`` of a step: decodes and speculative verification rows) on the lane kernel in every mode. Its prefill
rows (the rest) run, per mode:

* ``lane``: the lane kernel too (int16 activations per block of 32, exact int32 sums).
* ``bf16``: :class:`Bf16Prefill`: the weight dequantized into a bf16 scratch buffer shared by the model's layers
  (``lane_dequant_bf16``, leanserve/kernels/lane_dequant.cpp), then an AVX512_BF16 GEMM with fp32 accumulation and
  output (``bf16_gemm``): activations and weights rounded to bf16 (unit roundoff 2**-9 each).
* ``bf16x3``: the same with x and w split into bf16 high and low parts, three products (xh wh + xh wl + xl wh):
  about 2**-16 relative per product, three times the bf16 work.
* ``int8``: :class:`Int8Prefill`: 4-bit weights through ``lane_q8_gemm`` (leanserve/kernels/lane_q8_gemm.cpp):
  activations quantized to int8 per block of 32 (llama.cpp's q8_1 scheme, relative error up to 2**-8 of the
  block's largest value), exact int32 sums, fp32 output; 8-bit weights keep the lane kernel (AVX2 has no faster
  int8 x int8 product).
  On the default model its log-prob error against fp32 is about 4x bf16's (README.md, "Prefill GEMMs"), enough to
  change a greedy continuation sooner: the same arithmetic as llama.cpp's for these weights, and on AVX2 machines
  the fast prefill (on AVX-512 ones the lane kernel's 512-bit path is faster).
* ``auto``: ``bf16`` where the build has the AVX512_BF16 path (``ext.bf16_gemm_simd()``); else ``int8`` where
  ``lane_q8_gemm`` runs on AVX2 or AVX-VNNI (``ext.lane_q8_gemm_isa()``: the builds whose lane kernel has no
  512-bit path); else ``lane``. ``lane`` is the mode that keeps the fp32 promises on every machine. ``bf16`` and
  ``bf16x3`` without AVX512_BF16 run ``lane``, with a warning (the scalar fallback is far slower than the lane
  kernel).

The bf16 modes' GEMM runs on one of two engines, fixed per process (:func:`resolve_bf16_engine`): ``avx512_bf16``
(VDPBF16PS register tiles) or ``amx`` (Intel AMX TDPBF16PS tiles, leanserve/kernels/amx_gemm.cpp), where the CPU has
AMX-BF16, the kernel manages tile state and grants this process the tile permission (``arch_prctl``), and a
measurement at load finds it faster. ``$LEANSERVE_BF16_GEMM`` forces one (``avx512_bf16``, ``amx``; ``auto`` the
default). Both compute the same sums of the same bf16 products in fp32; the order of each pair's two products
differs, so their results may differ in the last bits, never a row's independence of the other rows.

Prefill rows take the mode's path whatever their number (one row or thousands), and each kernel computes a row
with the same instructions whatever the other rows are, so a prompt token's numbers do not depend on how the
prompt was chunked, batched with decodes or served from the prefix cache. Decode rows and prefill rows of the same
prompt position may differ in the last bits between ``lane`` and the other modes (different arithmetic); within
one mode every promise of ``lane`` that concerns prefill rows holds. Generated tokens recomputed after a preemption
are prefill rows of the recompute but run as decode rows (``recomputed_rows``), as they first ran, so a preempted
request continues as it would have. ``int8``'s kernel gives bit-identical products on every build (its int32 sums
are exact, its fp32 steps the same instructions); end to end, the other kernels of a build (attention, norms) differ
in the last bits between builds, and int8's rounding can magnify that (a prompt's log-probs measured up to 0.3 nats
apart between the native and the forced AVX2 build). Measured errors and speeds: README.md ("Prefill GEMMs").
"""

from __future__ import annotations

import logging
import os
from typing import Any

from leanserve.config import PREFILL_GEMMS
from leanserve.errors import EnvironmentSettingError, InvalidParameterError

import torch

logger = logging.getLogger(__name__)

BF16_GEMM_ENV = "LEANSERVE_BF16_GEMM"
# the engines of bf16_gemm (leanserve/kernels/lane_dequant.cpp); "amx_emulated" (the AMX tile program on a scalar
# model of the tiles, for tests) is not offered here: it is orders of magnitude slower
BF16_GEMM_ENGINES = ("avx512_bf16", "amx")


class Bf16Prefill:
    """Prefill products of lane-layout weights through a shared bf16 scratch copy of the weight.

    Attributes:
        ext: the native kernels (``leanserve.kernels.native_ops()``).
        hi: bf16 buffer of at least out * in elements (the weight's bf16 rounding, pair-packed), shared.
        lo: bf16 buffer like ``hi`` for ``bf16x3`` (the rounding residue), or an empty tensor for ``bf16``.
        engine: the GEMM engine, one of BF16_GEMM_ENGINES (or ``amx_emulated`` in tests).
    """

    __slots__ = ("ext", "hi", "lo", "engine")

    def __init__(self, ext: Any, hi: torch.Tensor, lo: torch.Tensor, engine: str = "avx512_bf16") -> None:
        self.ext, self.hi, self.lo, self.engine = ext, hi, lo, engine

    @property
    def mode(self) -> str:
        return "bf16x3" if self.lo.numel() else "bf16"

    def matmul(self, w: Any, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T``: x [M, in] float32, w a lane-layout BlockQuantWeight whose out * in fits the buffers;
        returns [M, out] float32 (``out``, a contiguous [M, out] float32 tensor, when given). Overwrites the shared
        buffers."""
        self.ext.lane_dequant_bf16(w.codes, w.d, w._mn(), w.bits, self.hi, self.lo)
        return self.ext.bf16_gemm(x, self.hi, self.lo, w.shape[0], self.engine, out)


class Int8Prefill:
    """Prefill products of lane-layout weights with int8 activations: ``lane_q8_gemm`` for 4-bit weights, the
    lane kernel for 8-bit ones.

    Attributes:
        ext: the native kernels (``leanserve.kernels.native_ops()``).
    """

    __slots__ = ("ext",)
    mode = "int8"
    engine = None  # one kernel: nothing to choose (see Bf16Prefill.engine)

    def __init__(self, ext: Any) -> None:
        self.ext = ext

    def matmul(self, w: Any, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T``: x [M, in] float32, w a lane-layout BlockQuantWeight; returns [M, out] float32 (``out``, a
        contiguous [M, out] float32 tensor, when given)."""
        if w.bits != 4:
            return w.kernel(x, out)
        return self.ext.lane_q8_gemm(x, w.codes, w.d, w.mn, out)


def asked_bf16_engine() -> str:
    """``$LEANSERVE_BF16_GEMM``: ``auto`` (unset or empty) or one of BF16_GEMM_ENGINES.

    Raises:
        EnvironmentSettingError: another value."""
    asked = os.environ.get(BF16_GEMM_ENV, "auto").strip().lower() or "auto"
    if asked not in ("auto", *BF16_GEMM_ENGINES):
        raise EnvironmentSettingError(BF16_GEMM_ENV, f"${BF16_GEMM_ENV} must be auto or one of "
                                      f"{', '.join(BF16_GEMM_ENGINES)}, not {asked!r}")
    return asked


def resolve_bf16_engine(ext: Any, w: Any, hi: torch.Tensor, lo: torch.Tensor, rows: int = 128) -> str:
    """The bf16 GEMM engine of this process: ``$LEANSERVE_BF16_GEMM`` when set to an engine, else (``auto``)
    ``amx`` when ``ext.amx_bf16_status()`` is ``ready`` and ``rows`` prefill rows of the weight ``w`` (a lane-layout
    BlockQuantWeight, dequantized into ``hi`` / ``lo`` here) run faster on it than on ``avx512_bf16`` and agree
    with it (within 1e-4 of the largest output: the engines differ in fp32 summation order only; a disagreement is
    logged as a warning and keeps ``avx512_bf16``), else ``avx512_bf16``. One engine for all row counts: a prompt
    token's numbers must not depend on its chunk's size.

    Raises:
        EnvironmentSettingError: see :func:`asked_bf16_engine`; ``amx`` asked where this process cannot run it
            (the status says why: build, cpu, os, permission)."""
    asked = asked_bf16_engine()
    status = ext.amx_bf16_status()
    if asked == "amx" and status != "ready":
        raise EnvironmentSettingError(BF16_GEMM_ENV, f"${BF16_GEMM_ENV}=amx, but this process cannot run AMX tiles "
                                      f"({status})")
    if asked != "auto" or status != "ready":
        return "avx512_bf16" if asked == "auto" else asked
    ext.lane_dequant_bf16(w.codes, w.d, w._mn(), w.bits, hi, lo)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0))
    from leanserve.quantization.weights import fastest_seconds

    runs = {e: (fastest_seconds(lambda e=e: ext.bf16_gemm(x, hi, lo, w.shape[0], e)),
                ext.bf16_gemm(x, hi, lo, w.shape[0], e)) for e in BF16_GEMM_ENGINES}
    (_, ref), (_, got) = runs["avx512_bf16"], runs["amx"]
    scale, diff = float(ref.abs().max()), float((got - ref).abs().max())
    if not diff <= 1e-4 * scale:
        logger.warning("the AMX engine's product disagrees with the AVX512_BF16 engine's (max difference %.3g of "
                       "%.3g): serving on avx512_bf16", diff, scale)
        return "avx512_bf16"
    engine = min(runs, key=lambda e: runs[e][0])
    logger.info("bf16 prefill GEMM engine %s (%d rows of a %dx%d weight: %s)", engine, rows, *w.shape,
                ", ".join(f"{e} {t * 1e3:.2f} ms" for e, (t, _) in runs.items()))
    return engine


def _check_mode(mode: str) -> None:
    """Raises InvalidParameterError when ``mode`` is not in PREFILL_GEMMS."""
    if mode not in PREFILL_GEMMS:
        raise InvalidParameterError("prefill_gemm", f"prefill_gemm must be one of {', '.join(PREFILL_GEMMS)}, "
                                    f"not {mode!r}")


def resolve_prefill_gemm(mode: str, ext: Any) -> str:
    """The mode that runs: ``lane`` as asked; ``int8`` where ``ext`` has ``lane_q8_gemm`` (else ``lane``, with a
    warning); ``bf16`` and ``bf16x3`` where ``ext`` has the AVX512_BF16 path, else ``lane`` (the bf16 kernels'
    scalar fallback is correct but ~40x slower than the lane kernel: logged as a warning); ``auto``: ``bf16`` with
    the AVX512_BF16 path, else ``int8`` where ``lane_q8_gemm`` runs on AVX2 or AVX-VNNI (the builds without the
    lane kernel's AVX-512 path), else ``lane``.

    Raises:
        InvalidParameterError: a mode not in PREFILL_GEMMS."""
    _check_mode(mode)
    simd = ext is not None and hasattr(ext, "bf16_gemm") and bool(ext.bf16_gemm_simd())
    int8 = ext is not None and hasattr(ext, "lane_q8_gemm")
    if mode == "lane" or (mode == "int8" and int8) or (mode in ("bf16", "bf16x3") and simd):
        return mode
    if mode == "auto":
        if simd:
            return "bf16"
        return "int8" if int8 and ext.lane_q8_gemm_isa() in ("avx2", "avx_vnni") else "lane"
    if mode == "int8":
        logger.warning("--prefill-gemm int8 needs the native kernels: prefill rows run the lane kernel")
    else:
        logger.warning("--prefill-gemm %s needs the AVX512_BF16 kernels, which this build lacks (%s): prefill "
                       "rows run the lane kernel (--prefill-gemm int8 is the fast prefill there)", mode,
                       "no native kernels" if ext is None else "no AVX512_BF16, or LEANSERVE_KERNEL_ISA=avx2")
    return "lane"


def _lane_weights(model: Any) -> list[Any]:
    """The lane-layout BlockQuantWeights among the attributes of ``model.layers`` (``__slots__`` included)."""
    from leanserve.quantization.weights import BlockQuantWeight

    def attributes(layer: Any) -> list[Any]:  # a plain object's or a __slots__ class's (Gemma3Layer) attributes
        if hasattr(layer, "__dict__"):
            return list(vars(layer).values())
        return [getattr(layer, name, None) for name in getattr(type(layer), "__slots__", ())]

    return [t for layer in getattr(model, "layers", []) for t in attributes(layer)
            if isinstance(t, BlockQuantWeight) and t.lanes]


def has_lane_weights(model: Any) -> bool:
    """Whether ``model.layers`` hold lane-layout BlockQuantWeights: the only weights ``--prefill-gemm`` applies to
    (float, torch-quantized int8/int4 and file-layout projections run their own kernels at every row count)."""
    return bool(_lane_weights(model))


def prefill_gemm_engine(model: Any) -> str | None:
    """The bf16 GEMM engine ``configure_prefill_gemm`` gave ``model``'s prefill rows, or None (lane or int8)."""
    prefill = next((w.prefill for w in _lane_weights(model) if w.prefill is not None), None)
    return prefill.engine if prefill is not None else None


def configure_prefill_gemm(model: Any, mode: str) -> str:
    """Sets the prefill kernel of every lane-layout BlockQuantWeight of ``model.layers`` (attributes of each
    layer, ``__slots__`` included) to ``mode`` (resolved by :func:`resolve_prefill_gemm`); the bf16 modes share one
    pair of scratch buffers sized for the largest and one GEMM engine (:func:`resolve_bf16_engine`, measured on the
    largest); the output head and the embedding keep the lane kernel (logits rows are not prefill rows).
    Returns the resolved mode. Calling it again replaces the previous setting.

    Raises:
        InvalidParameterError: an unknown mode.
        EnvironmentSettingError: a bad ``$LEANSERVE_BF16_GEMM`` (see :func:`resolve_bf16_engine`)."""
    weights = _lane_weights(model)
    engine = asked_bf16_engine()  # a bad $LEANSERVE_BF16_GEMM fails whatever the mode
    if not weights:  # no lane-layout weights (float or torch-quantized projections): no prefill kernel to set
        _check_mode(mode)
        if mode not in ("auto", "lane"):
            logger.warning("--prefill-gemm %s is not used: it chooses the prefill kernel of lane-layout weights "
                           "(GGUF Q4_0/Q4_1/Q8_0 with the native kernels, or --quantization int4 at group size "
                           "32), and this model's projections run their own kernels at every row count", mode)
        if engine != "auto":
            logger.warning("$%s=%s is not used: this model has no lane-layout weights, so no prefill row runs a "
                           "bf16 GEMM", BF16_GEMM_ENV, engine)
        return "lane"
    ext = weights[0].ext
    resolved = resolve_prefill_gemm(mode, ext)
    if engine != "auto" and resolved not in ("bf16", "bf16x3"):
        logger.warning("$%s=%s is not used: prefill rows run the %s kernel, not a bf16 GEMM", BF16_GEMM_ENV,
                       engine, resolved)
    prefill: Any = None
    if resolved == "int8":
        prefill = Int8Prefill(ext)
    elif resolved != "lane":
        largest = max(weights, key=lambda w: w.shape[0] * w.shape[1])
        size = largest.shape[0] * largest.shape[1]
        hi = torch.empty(size, dtype=torch.bfloat16)
        lo = torch.empty(size if resolved == "bf16x3" else 0, dtype=torch.bfloat16)
        prefill = Bf16Prefill(ext, hi, lo, resolve_bf16_engine(ext, largest, hi, lo))
    for w in weights:
        w.prefill = prefill
    return resolved
