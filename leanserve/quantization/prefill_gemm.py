"""The kernel of prefill rows for lane-layout GGUF weights (``--prefill-gemm``): the lane kernel, or bf16.

A lane-layout :class:`~leanserve.quantization.weights.BlockQuantWeight` runs its decode rows (the leading
``kernel_rows`` of a step: decodes and speculative verification rows) on the lane kernel in every mode. Its prefill
rows (the rest) run, per mode:

* ``lane``: the lane kernel too (int16 activations per block of 32, exact int32 sums).
* ``bf16``: :class:`Bf16Prefill`: the weight dequantized into a bf16 scratch buffer shared by the model's layers
  (``lane_dequant_bf16``, leanserve/kernels/lane_dequant.cpp), then an AVX512_BF16 GEMM with fp32 accumulation and
  output (``bf16_gemm``): activations and weights rounded to bf16 (unit roundoff 2**-9 each).
* ``bf16x3``: the same with x and w split into bf16 high and low parts, three products (xh wh + xh wl + xl wh):
  about 2**-16 relative per product, three times the bf16 work.
* ``auto``: ``bf16`` where the build has the AVX512_BF16 path (``ext.bf16_gemm_simd()``), else ``lane``.

Prefill rows take the mode's path whatever their number (one row or thousands), and each kernel computes a row
with the same instructions whatever the other rows are, so a prompt token's numbers do not depend on how the
prompt was chunked, batched with decodes or served from the prefix cache. Decode rows and prefill rows of the same
prompt position may differ in the last bits between ``lane`` and the bf16 modes (different arithmetic); within one
mode every promise of ``lane`` that concerns prefill rows holds. Measured errors and speeds: README.md ("Prefill
GEMMs").
"""

from __future__ import annotations

from typing import Any

from leanserve.config import PREFILL_GEMMS
from leanserve.errors import InvalidParameterError

import torch


class Bf16Prefill:
    """Prefill products of lane-layout weights through a shared bf16 scratch copy of the weight.

    Attributes:
        ext: the native kernels (``leanserve.kernels.native_ops()``).
        hi: bf16 buffer of at least out * in elements (the weight's bf16 rounding, pair-packed), shared.
        lo: bf16 buffer like ``hi`` for ``bf16x3`` (the rounding residue), or an empty tensor for ``bf16``.
    """

    __slots__ = ("ext", "hi", "lo")

    def __init__(self, ext: Any, hi: torch.Tensor, lo: torch.Tensor) -> None:
        self.ext, self.hi, self.lo = ext, hi, lo

    @property
    def mode(self) -> str:
        return "bf16x3" if self.lo.numel() else "bf16"

    def matmul(self, w: Any, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T``: x [M, in] float32, w a lane-layout BlockQuantWeight whose out * in fits the buffers;
        returns [M, out] float32. Overwrites the shared buffers."""
        self.ext.lane_dequant_bf16(w.codes, w.d, w._mn(), w.bits, self.hi, self.lo)
        return self.ext.bf16_gemm(x, self.hi, self.lo, w.shape[0])


def resolve_prefill_gemm(mode: str, ext: Any) -> str:
    """The mode that runs: ``auto`` -> ``bf16`` when ``ext`` has the AVX512_BF16 path, else ``lane``; ``bf16`` and
    ``bf16x3`` as asked when ``ext`` has the kernels (their scalar fallback is correct but slow), else ``lane``.

    Raises:
        InvalidParameterError: a mode not in PREFILL_GEMMS."""
    if mode not in PREFILL_GEMMS:
        raise InvalidParameterError("prefill_gemm", f"prefill_gemm must be one of {', '.join(PREFILL_GEMMS)}, "
                                    f"not {mode!r}")
    has = ext is not None and hasattr(ext, "bf16_gemm")
    if mode == "auto":
        return "bf16" if has and ext.bf16_gemm_simd() else "lane"
    return mode if has else "lane"


def configure_prefill_gemm(model: Any, mode: str) -> str:
    """Sets the prefill kernel of every lane-layout BlockQuantWeight of ``model.layers`` (attributes of each
    layer, ``__slots__`` included) to ``mode`` (resolved by :func:`resolve_prefill_gemm`), sharing one pair of
    scratch buffers sized for the largest; the output head and the embedding keep the lane kernel (logits rows are
    not prefill rows).
    Returns the resolved mode. Calling it again replaces the previous setting.

    Raises:
        InvalidParameterError: an unknown mode."""
    from leanserve.quantization.weights import BlockQuantWeight

    def attributes(layer: Any) -> list[Any]:  # a plain object's or a __slots__ class's (Gemma3Layer) attributes
        if hasattr(layer, "__dict__"):
            return list(vars(layer).values())
        return [getattr(layer, name, None) for name in getattr(type(layer), "__slots__", ())]

    weights = [t for layer in getattr(model, "layers", []) for t in attributes(layer)
               if isinstance(t, BlockQuantWeight) and t.lanes]
    ext = weights[0].ext if weights else None
    resolved = resolve_prefill_gemm(mode, ext)
    prefill = None
    if resolved != "lane" and weights:
        size = max(w.shape[0] * w.shape[1] for w in weights)
        hi = torch.empty(size, dtype=torch.bfloat16)
        lo = torch.empty(size if resolved == "bf16x3" else 0, dtype=torch.bfloat16)
        prefill = Bf16Prefill(ext, hi, lo)
    for w in weights:
        w.prefill = prefill
    return resolved if weights else "lane"
