"""The model's weight matrices, each owning the one ``matmul`` that picks its kernel (gpt-fast style: the model
holds one of these for every projection, and a quantization method only changes which class it holds).

* :class:`LinearWeight` -- the protocol they share: ``w.matmul(x, bias=None, *, kernel_rows=None, invariant_rows=0)``.
* :class:`FloatWeight` -- a float32 / bfloat16 matrix (``quantization="none"``, and float tensors under ``auto``).
* :class:`Int8Weight` -- int8 codes with a scale per output row (symmetric per channel), or per group of input
  columns (GGUF Q8_0: groups of 32).
* :class:`Int4Weight` -- 4-bit codes in torch's CPU packed layout with a scale and a zero point per group of
  32, 64 or 128 input columns: ``w = (q - 8) * scale + zero`` (the convention of ``_weight_int4pack_mm_for_cpu``).
* :class:`BlockQuantWeight` -- a GGUF Q4_0 / Q4_1 / Q8_0 matrix holding the file's codes and fp16 scales, in lane
  layout or file layout, for leanserve's own kernels (``leanserve/kernels/block_quant_gemm.cpp``): fp32
  activations and output, exact weights.
* :class:`GroupQuantized` -- the exact, unpacked form of a GGUF Q4_0 / Q4_1 / Q8_0 tensor as the loader reads it
  (not a :class:`LinearWeight`); :func:`pack_group_quantized` turns it into one of the above without
  re-quantizing, :func:`quantize_weight` applies a ``--quantization`` method.

Kernel per class and row count T (the reasons; measurements are in README.md and ``benchmarks/quant.py``):

* :class:`FloatWeight`: float32 on CPU with NumPy's BLAS (:func:`numpy_blas_enabled`): OpenBLAS gemv at T = 1,
  gemm at T > 1 (it streams weights faster than torch's path in the decode matrix-vector products); bfloat16 on CPU
  at T > :func:`bf16_gemm_max_rows` (measured per machine: 8 rows where the CPU has no fast bf16 GEMM, no limit
  with AVX512_BF16 / AMX): the product in float32 (a bf16 gemv is fast, half the bytes); else
  ``torch.nn.functional.linear``.
* :class:`Int8Weight` (per channel) / :class:`Int4Weight`: torch's ``_weight_int8pack_mm`` /
  ``_weight_int4pack_mm_for_cpu`` at every T, on activations rounded to bf16 (those kernels are fast only with bf16
  activations, and then at least as fast as the fp32 GEMM at every batch size); their bf16 output is returned in
  x's dtype. Per-group int8 (Q8_0) has no torch kernel: it is dequantized per call (correct, memory-saving, slow).
* :class:`BlockQuantWeight`: lane layout: the lane kernel at every T (prefill rows: the lane kernel, bf16 or int8, per
  ``--prefill-gemm``, leanserve/quantization/prefill_gemm.py). File layout: the block kernel on decode rows
  while there are at most :data:`BLOCK_KERNEL_MAX_ROWS` of them, dequantize + :class:`FloatWeight` GEMM on prefill
  rows (and on decode rows beyond that count, where the GEMM is faster).

Numerics: scales and zero points of :class:`Int8Weight` / :class:`Int4Weight` are stored in bf16 (the kernels
require it), and quantization from float rounds them to bf16 *before* choosing the codes, so :meth:`dequantize` is
exactly what the kernel multiplies by. Their matmul then differs from ``x @ dequantize().T`` in fp32 only by the
bf16 rounding of the activations and of the output (unit roundoff 2**-8 each):
``|y - ref| <= 2**-7 * (|x| @ |W|.T)`` elementwise, up to fp32 summation error. :class:`BlockQuantWeight` is much
closer: its kernels round activations to int16 per block of 32 (2**-16 of the block's largest value) and
accumulate in exact int32 and fp32 (bounds checked in tests/quantization/test_block_quant.py and, on the default
model, tests/quantization/test_quality.py).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leanserve.errors import UnsupportedQuantizationError
from leanserve.quantization.int4_pack import pack_int4, unpack_int4

import numpy as np
import torch
import torch.nn.functional as F

RowRanges = Sequence[tuple[int, int]]  # (start, stop) row ranges of a step


class LinearWeight(Protocol):
    """A weight matrix W [out, in] (``nn.Linear`` layout) that multiplies activations with its own kernel.

    ``matmul(x, bias=None, *, kernel_rows=None, invariant_rows=0, recomputed_rows=())`` returns ``x @ W.T + bias``:

    * ``x``: [T, in], float32 or bfloat16 (the model dtype; a :class:`FloatWeight` expects its own dtype).
    * ``bias``: [out] in x's dtype, or None: fused into ``F.linear`` where a class runs that, else added to the
      product; it never changes which kernel runs.
    * ``kernel_rows``: how many leading rows of ``x`` are decode tokens (one per sequence; the rest of the step are
      prefill tokens, as the model runner orders a step); None: all rows alike. Only a kernel whose choice must not
      depend on how a prompt was chunked reads it (:class:`BlockQuantWeight`: file layout, and lane layout with a
      bf16 prefill path).
    * ``recomputed_rows``: row ranges ``(start, stop)`` among the prefill rows that hold generated tokens recomputed
      after a preemption: a kernel that treats prefill rows differently from decode rows (a lane-layout
      :class:`BlockQuantWeight` with a prefill kernel) computes them as decode rows, as they were first computed,
      so that a preempted request continues as it would have; the other classes ignore it.
    * ``invariant_rows``: 0, or batch-invariant mode: every row is computed by the same kernel whatever T is (a
      :class:`FloatWeight` on NumPy's BLAS runs gemm on chunks of exactly ``invariant_rows`` rows; a file-layout
      :class:`BlockQuantWeight` keeps its block kernel at every T; the other kernels are row-invariant already).
    * returns [T, out] in x's dtype (the bf16 rule of :class:`FloatWeight` aside: bf16 weights give bf16).
    """

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the matrix holds (packed codes and scales for the quantized classes)."""
        ...

    def dequantize(self) -> torch.Tensor:
        """W as a float32 [out, in] tensor."""
        ...

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ W.T + bias``: x [T, in] -> [T, out] (see the class notes)."""
        ...


def numpy_blas_enabled() -> bool:
    """Whether fp32 CPU matmuls may use NumPy's BLAS: only when OpenMP waits passively (see leanserve/__init__)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


_NUMPY_BLAS = numpy_blas_enabled()  # read once, at import (leanserve/__init__ sets the policy before torch loads)

# Rows above which a bf16 matmul on CPU runs in fp32 on a CPU without a fast bf16 GEMM (no AVX512_BF16 / AMX: a
# bf16 matrix-vector product is still fast, half the bytes of fp32). Which kind this CPU is: bf16_gemm_max_rows().
BF16_GEMM_MAX_ROWS = 8
NO_ROW_LIMIT = 1 << 62  # bf16_gemm_max_rows() where bf16 GEMMs are fast: every bf16 product stays in bf16


def fastest_seconds(f: Callable[[], object], repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``f`` after one warm-up call (load only adds time)."""
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


@functools.cache
def bf16_gemm_max_rows() -> int:
    """Rows above which a bfloat16 CPU matmul runs in float32: :data:`BF16_GEMM_MAX_ROWS` when torch's bf16 GEMM
    is slower than its fp32 GEMM on this machine, else :data:`NO_ROW_LIMIT`. Measured once per process on a
    model-sized product (64 and 256 rows x 576 -> 1536, the fastest of 3 runs each): bf16 must win at both
    (oneDNN's AVX512_BF16 / AMX kernels do; without them bf16 is emulated and several times slower)."""
    w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))
    wb = w.to(torch.bfloat16)

    for m in (64, 256):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        xb = x.to(torch.bfloat16)
        if fastest_seconds(lambda xb=xb: F.linear(xb, wb)) >= fastest_seconds(lambda x=x: F.linear(x, w)):
            return BF16_GEMM_MAX_ROWS
    return NO_ROW_LIMIT

# Rows of every BLAS gemm call in batch-invariant mode (the model's ``invariant_rows``). OpenBLAS rounds a row of
# x @ w.T differently for different M on some CPUs (its Haswell kernels: M = 3 vs M >= 7), but with M fixed a row's
# result depends neither on its position in the call nor on the other rows (checked for the default model's shapes
# on both machine kinds: tests/model/test_batch_invariance.py); so x is cut into chunks of exactly this many rows,
# the last one zero-padded.
INVARIANT_ROWS = 8


SMALL_GEMM_MAX_ROWS = 8  # float32 products of up to this many rows run the native small-batch kernel


@functools.cache
def torch_gemm_max_rows() -> int:
    """Most rows for which fp32 products run torch's GEMM rather than NumPy's BLAS gemm, measured once per process
    on a model-sized matrix (576 x 1536): the largest of 64, 32, ..., 2 rows at which torch was faster (0 when
    never; larger row counts are assumed to favour NumPy too). NumPy's OpenBLAS gemm is slow for few rows on some
    CPUs while its gemv and large GEMMs stay fast. The choice depends only on a step's row count."""
    if not _NUMPY_BLAS:
        return 0
    w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))
    wnt = w.numpy().T

    for m in (64, 32, 16, 8, 4, 2):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        xn = x.numpy()
        if fastest_seconds(lambda x=x: F.linear(x, w)) < fastest_seconds(lambda xn=xn: xn @ wnt):
            return m
    return 0


class FloatWeight:
    """A float matrix ``weight`` [out, in] (float32 or bfloat16, on any device) and its matmul.

    Kernel, for x [T, in] (see :class:`LinearWeight` for the arguments):

    * float32 on CPU with the native kernels (``ext``) and T <= :data:`SMALL_GEMM_MAX_ROWS` (not in
      batch-invariant mode): ``ext.f32_small_gemm``, which reads the weight once for all T rows and computes each row
      with the same operations whatever T is (a row's result is bitwise independent of the others). Returns float32.
    * float32 on CPU with :func:`numpy_blas_enabled` (float32 x): NumPy's BLAS: gemv at T = 1, gemm at T > 1 (torch's
      GEMM up to :func:`torch_gemm_max_rows` rows, where it measured faster on this machine); with
      ``invariant_rows`` (batch-invariant mode), gemm on chunks of exactly that many rows, the last zero-padded, so
      every row goes through the same kernel whatever T is. Returns float32; the bias is added to the product.
    * bfloat16 on CPU at T > :func:`bf16_gemm_max_rows` (8 on a CPU without a fast bf16 GEMM, no limit with one):
      ``F.linear`` in float32 (x, weight and bias widened), rounded to bfloat16.
    * otherwise ``F.linear(x, weight, bias)``.

    ``kernel_rows`` is accepted for the common signature and not read. The NumPy view of the weight and the kernel
    flags are fixed at construction: the weight tensor must not be replaced or resized afterwards.

    Attributes:
        weight: the [out, in] tensor (contiguous, as the model builds it).
    """

    __slots__ = ("weight", "_wn", "_wnt", "_bf16_cpu", "_small")

    def __init__(self, weight: torch.Tensor, ext: Any = None) -> None:
        """weight: [out, in]; ext: the native kernels (:func:`leanserve.kernels.native_ops`) or None."""
        self.weight = weight
        cpu = weight.device.type == "cpu"
        self._small = ext if (ext is not None and cpu and weight.dtype == torch.float32
                              and hasattr(ext, "f32_small_gemm")) else None
        self._wn = weight.numpy() if _NUMPY_BLAS and cpu and weight.dtype == torch.float32 else None
        self._wnt = None if self._wn is None else self._wn.T
        if self._wn is not None:
            torch_gemm_max_rows()  # measured once, when the first float32 CPU weight is built
        self._bf16_cpu = cpu and weight.dtype == torch.bfloat16
        if self._bf16_cpu:
            bf16_gemm_max_rows()  # measured once, when the first bfloat16 CPU weight is built

    def __repr__(self) -> str:
        return f"FloatWeight(shape={tuple(self.weight.shape)}, dtype={self.weight.dtype}, device={self.weight.device})"

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix (the tensor itself when it is float32)."""
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``weight[ids]``: [len(ids), in] in the weight's dtype (an embedding lookup). ids: [T] int64."""
        return F.embedding(ids, self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ weight.T + bias``: x [T, in] -> [T, out] (kernel per the class notes)."""
        if (self._small is not None and not invariant_rows and x.dtype == torch.float32
                and 0 < x.shape[0] <= SMALL_GEMM_MAX_ROWS):
            y = self._small.f32_small_gemm(x, self.weight)
            return y if bias is None else y + bias
        wn = self._wn
        if wn is not None and x.dtype == torch.float32:
            t = x.shape[0]
            if invariant_rows:
                c = invariant_rows
                xp = torch.zeros(-(-t // c) * c, x.shape[1])
                xp[:t] = x
                xn, wnt = xp.numpy(), self._wnt
                y = torch.from_numpy(np.concatenate([xn[i:i + c] @ wnt for i in range(0, xn.shape[0], c)]))[:t]
            elif t == 1:
                y = torch.from_numpy(wn @ x.numpy()[0]).unsqueeze(0)  # BLAS gemv
            elif t <= torch_gemm_max_rows():
                return F.linear(x, self.weight, bias)  # small batches: torch's GEMM where NumPy's is slower
            else:
                y = torch.from_numpy(x.numpy() @ self._wnt)  # BLAS gemm
            return y if bias is None else y + bias
        if self._bf16_cpu and x.shape[0] > bf16_gemm_max_rows():
            return F.linear(x.float(), self.weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
        return F.linear(x, self.weight, bias)


@dataclass
class Int8Weight:
    """An int8 weight-only matrix, ``w[n, k] = qweight[n, k] * scales[n, k // group_size]``.

    Attributes:
        qweight: [out, in] int8 codes (-127..127 when quantized here).
        scales: [out] bf16 per-channel scales when ``group_size == in``; else [out, in // group_size] float32.
        group_size: input columns per scale (``in`` = per channel).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Weight:
        """Symmetric per-output-channel int8 (gpt-fast's ``WeightOnlyInt8``): scale = max|w_row| / 127, rounded
        to bf16 first; codes = round(w / scale). w: [out, in] float."""
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.contiguous(), w.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix the codes and scales represent."""
        out, k = self.shape
        if self.group_size == k:
            return self.qweight.float() * self.scales.float()[:, None]
        q = self.qweight.float().view(out, k // self.group_size, self.group_size)
        return (q * self.scales.float()[..., None]).view(out, k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ w.T + bias``: x [T, in] float -> [T, out] in x's dtype; per channel, ``_weight_int8pack_mm`` on x
        rounded to bf16; per group, fp32 ``F.linear`` on the dequantized matrix. Row-invariant at every T, so
        ``kernel_rows`` and ``invariant_rows`` are not read. The bias is added to the product."""
        if self.group_size == self.qweight.shape[1]:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scales)
        else:
            y = F.linear(x.float(), self.dequantize())
        y = y.to(x.dtype)
        return y if bias is None else y + bias


@dataclass
class Int4Weight:
    """A 4-bit group-wise weight-only matrix in torch's CPU packed layout: ``w = (q - 8) * scale + zero``.

    Attributes:
        packed: [out, in // 2] uint8 (see :mod:`leanserve.quantization.int4_pack`).
        scales_and_zeros: [in // group_size, out, 2] bf16: (scale, zero) per group and output row.
        group_size: input columns per group (32, 64 or 128).
        in_features: input width.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.packed.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes, scales and zeros."""
        return self.packed.numel() + self.scales_and_zeros.numel() * 2

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> Int4Weight:
        """Build from codes [out, in] (0..15) and float scale, zero [out, in // group_size] (rounded to bf16).

        Raises:
            UnsupportedQuantizationError: ``in`` is not a multiple of ``group_size``.
        """
        out, k = codes.shape
        _check_group_size(k, group_size)
        sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)  # [out, groups, 2]
        return cls(pack_int4(codes), sz.transpose(0, 1).contiguous(), group_size, k)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 32) -> Int4Weight:
        """Asymmetric min/max 4-bit quantization per group of ``group_size`` inputs (gpt-fast's
        ``group_quantize_tensor``): scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to bf16;
        codes = clamp(round((w - zero) / scale) + 8, 0, 15). w: [out, in] float.

        Raises:
            UnsupportedQuantizationError: ``in`` is not a multiple of ``group_size``.
        """
        out, k = w.shape
        _check_group_size(k, group_size)
        wg = w.float().reshape(out, k // group_size, group_size)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = torch.round((wg - zero[..., None]) / scale[..., None]) + 8
        return cls.from_codes(q.clamp(0, 15).reshape(out, k), scale, zero, group_size)

    def codes(self) -> torch.Tensor:
        """The codes [out, in] uint8 (0..15), unpacked. Raises ValueError when ``out % int4_pack.block_rows()``."""
        return unpack_int4(self.packed)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix the kernel multiplies by. Raises ValueError as :meth:`codes` does."""
        out, k = self.shape
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
        q = self.codes().float().view(out, k // self.group_size, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(out, k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ w.T + bias``: x [T, in] float -> [T, out] in x's dtype, through ``_weight_int4pack_mm_for_cpu``
        on x rounded to bf16. Row-invariant at every T, so ``kernel_rows`` and ``invariant_rows`` are not read. The bias
        is added to the product."""
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


# Decode rows up to which a BlockQuantWeight in file layout (an output width not divisible by 64) runs its block
# kernel; with more, it dequantizes to fp32 and runs the float GEMM, which is then the faster of the two (the
# crossover of benchmarks/quant.py's kernel table for the default model's matrices).
BLOCK_KERNEL_MAX_ROWS = 40


@dataclass
class BlockQuantWeight:
    """A GGUF Q4_1 / Q4_0 / Q8_0 matrix holding the file's codes and fp16 scales, for leanserve's native kernels.

    ``w[n, k] = d[n, b] * q[n, k] + mn[n, b]`` for the block ``b = k // 32`` (Q4_0 is held as Q4_1 with
    ``mn = -8 d``, exact in fp16; Q8_0 has no ``mn``). Two layouts of the same bytes:

    * lane layout (``lanes=True``, what :meth:`from_group` makes when the output width is a multiple of 64 and the
      lane kernel is compiled): the file's bytes permuted so that 8 outputs fill one register's lanes;
      ``lane_quant_gemm`` (leanserve/kernels/block_quant_gemm.cpp) runs every product, one row or thousands: int16
      activations per block of 32, exact int32 dot products, fp32 output, each row's result independent of the
      others (so prefix caching, chunking and batching never change a token's numbers).
    * file layout (other widths): ``block_quant_gemm`` (the same arithmetic, row by row) on decode rows, while
      there are at most :data:`BLOCK_KERNEL_MAX_ROWS` of them; dequantize to fp32 and the :class:`FloatWeight`
      GEMM for the others (see :meth:`matmul`).

    Attributes:
        codes: file layout: 4-bit [out, in // 2] uint8 in ggml's nibble order (byte j of a block: element j low,
            j + 16 high), 8-bit [out, in] int8. Lane layout: [out // 64, in // 32, 8, P, 8, 2] with P = 8 (4-bit)
            or 16 (8-bit): element (t, b, g, p, l, i) = byte 2p + i of block b of output 64t + 8g + l.
        d: [out, in // 32] float16 block scales (lane layout: [out // 64, in // 32, 8, 8]).
        mn: block offsets (4-bit) in the same layout as ``d``, or None (8-bit).
        bits: 4 or 8.
        ext: the compiled extension (leanserve.kernels.native_ops()).
        scratch: a float32 buffer the file layout's large-batch path dequantizes into when it is big enough (the
            model shares one among its layers, so the fp32 copy stays in cache), or None.
        lanes: which layout ``codes``, ``d`` and ``mn`` are in.
        prefill: lane layout: the kernel of prefill rows other than the lane kernel
            (:class:`leanserve.quantization.prefill_gemm.Bf16Prefill` or ``Int8Prefill``, set by
            ``configure_prefill_gemm``), or None.
    """

    codes: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None
    bits: int
    ext: Any
    scratch: torch.Tensor | None = None
    lanes: bool = False
    prefill: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        if self.lanes:
            tiles, blocks = self.codes.shape[:2]
            return (tiles * 64, blocks * 32)
        out, width = self.codes.shape
        return (out, width * 2 if self.bits == 4 else width)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales (Q4_1: 5 bits per weight, Q8_0: 8.5)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.mn) if t is not None)

    @classmethod
    def from_group(cls, g: GroupQuantized, ext: Any, lanes: bool = True) -> BlockQuantWeight:
        """Repack ``g``'s codes into the file's bytes, its scales back to the file's fp16 (exact: the loader widened
        them from fp16); in lane layout when ``lanes``, the output width is a multiple of 64 and ``ext`` has the
        lane kernel.

        Raises:
            ValueError: a group size other than 32, or a Q4_0 scale too large for ``-8 d`` in fp16.
        """
        if g.group_size != 32:
            raise ValueError(f"block kernels need groups of 32, got {g.group_size}")
        d = g.scale.to(torch.float16)
        if g.bits == 8:
            w = cls(g.codes.to(torch.int8).contiguous(), d.contiguous(), None, 8, ext)
        else:
            mn = g.bias if g.bias is not None else torch.zeros_like(g.scale)
            if g.offset:
                mn = mn - g.offset * g.scale
            mn16 = mn.to(torch.float16)
            if not torch.equal(mn16.float(), mn):
                raise ValueError("a block offset is not exact in float16")
            out, k = g.shape
            c = g.codes.view(out, k // 32, 32)
            packed = (c[..., :16] | (c[..., 16:] << 4)).reshape(out, k // 2)
            w = cls(packed.contiguous(), d.contiguous(), mn16.contiguous(), 4, ext)
        if lanes and w.shape[0] % 64 == 0 and hasattr(ext, "lane_quant_gemm"):
            w = w.to_lanes()
        return w

    def to_lanes(self) -> BlockQuantWeight:
        """The same bytes in lane layout (a copy). Raises ValueError when the output width is not a multiple of 64."""
        if self.lanes:
            return self
        out, k = self.shape
        if out % 64:
            raise ValueError(f"the lane layout needs a multiple of 64 outputs, got {out}")
        nb, pairs = k // 32, 8 if self.bits == 4 else 16

        def scales(s: torch.Tensor | None) -> torch.Tensor | None:  # [tile, group, lane, b] -> [tile, b, group, lane]
            return None if s is None else s.view(out // 64, 8, 8, nb).permute(0, 3, 1, 2).contiguous()

        # [tile, group, lane, b, p, i] -> [tile, b, group, p, lane, i], each (i = 0, 1) byte pair moved as one int16
        # (the same bytes: torch copies strided 2-byte elements far faster than pairs of bytes)
        pair16 = self.codes.contiguous().view(torch.int16).view(out // 64, 8, 8, nb, pairs)
        codes = pair16.permute(0, 3, 1, 4, 2).contiguous().view(self.codes.dtype).view(out // 64, nb, 8, pairs, 8, 2)
        return BlockQuantWeight(codes, scales(self.d), scales(self.mn), self.bits, self.ext, self.scratch, lanes=True)

    def _file_rows(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, d and mn (or an empty fp16 tensor) of the rows ``ids`` (None: all) in file layout."""
        if not self.lanes:
            if ids is None:
                return self.codes, self.d, self._mn()
            mn = self.mn[ids].contiguous() if self.mn is not None else _NONE_F16
            return self.codes[ids].contiguous(), self.d[ids].contiguous(), mn
        # lane layout: one native pass (the extension that made the lanes has the gather); float ids: its dtype error
        ids = torch.arange(self.shape[0]) if ids is None else ids
        ids = ids if ids.is_floating_point() else ids.to(torch.int64)
        return self.ext.lane_gather_rows(self.codes, self.d, self._mn(), self.bits, ids)

    def dequantize(self, use_scratch: bool = False) -> torch.Tensor:
        """The float32 [out, in] matrix, equal to gguf-py's dequantization of the source tensor. With
        ``use_scratch``, it is written into :attr:`scratch` when that is big enough: valid only until the next
        such call on a weight sharing the buffer."""
        buf = self.scratch if use_scratch and self.scratch is not None else _NONE
        if buf.numel() < self.shape[0] * self.shape[1]:
            buf = _NONE
        codes, d, mn = self._file_rows()
        return self.ext.block_dequantize(codes, d, mn, self.bits, buf)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``w[ids]``: [len(ids), in] float32 (an embedding lookup). ids: [T] int64."""
        codes, d, mn = self._file_rows(ids)
        return self.ext.block_dequantize(codes, d, mn, self.bits, _NONE)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ w.T + bias``: x [T, in] float -> [T, out] in x's dtype (computed in float32; bias added after).

        Lane layout: the lane kernel on every row (each row's result independent of the others), except that with
        :attr:`prefill` set the rows after the first ``kernel_rows`` (prefill tokens, however many; none when
        ``kernel_rows`` is None or in batch-invariant mode) run that kernel (bf16 or int8, see
        leanserve/quantization/prefill_gemm.py). File layout: the
        block kernel on the first ``kernel_rows`` rows (decode tokens; None: all T) when there are at most
        :data:`BLOCK_KERNEL_MAX_ROWS` of them, else on none; dequantize (into :attr:`scratch`) + the
        :class:`FloatWeight` GEMM on the other rows (prefill tokens always take that path, so a prompt token's
        result does not depend on how the prompt was chunked or how much of it came from the prefix cache). With
        ``invariant_rows`` (batch-invariant mode) every row runs the block kernel.
        """
        t = x.shape[0]
        if self.lanes and self.prefill is not None and not invariant_rows and kernel_rows is not None \
                and kernel_rows < t:  # prefill rows through the prefill kernel
            xf = (x if x.dtype == torch.float32 else x.float()).contiguous()
            n = kernel_rows
            y = torch.empty(t, self.shape[0])  # decode rows and prefill rows written in place: no concatenation
            if n:
                self.kernel(xf[:n], out=y[:n])
            self.prefill.matmul(self, xf[n:], out=y[n:])
            # generated tokens recomputed after a preemption: as they were computed (the prefill call above covered
            # them too: one call, because the bf16 modes dequantize the weight per call; such rows are rare)
            for a, b in recomputed_rows:
                self.kernel(xf[a:b], out=y[a:b])
            y = y if y.dtype == x.dtype else y.to(x.dtype)
            return y if bias is None else y + bias
        if self.lanes or invariant_rows:  # every row through the kernel
            n = t
        else:  # leading rows that run the kernel
            n = t if kernel_rows is None else kernel_rows
            if n > BLOCK_KERNEL_MAX_ROWS:
                n = 0
        xf = x if x.dtype == torch.float32 else x.float()
        if n == t:
            y = self.kernel(xf)
        elif n == 0:
            y = FloatWeight(self.dequantize(use_scratch=True)).matmul(xf)
        else:
            y = torch.cat([self.kernel(xf[:n]), FloatWeight(self.dequantize(use_scratch=True)).matmul(xf[n:])])
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if bias is None else y + bias

    def kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T`` through the lane or block kernel at any M: x [M, in] float32, returns [M, out] float32
        (``out``, a contiguous [M, out] float32 tensor, when given: lane layout only).

        Raises:
            ValueError: ``out`` with the file layout."""
        if self.lanes:
            return self.ext.lane_quant_gemm(x.contiguous(), self.codes, self.d, self._mn(), self.bits, out)
        if out is not None:
            raise ValueError("the block kernel (file layout) allocates its output: out is for the lane layout")
        return self.ext.block_quant_gemm(x.contiguous(), self.codes, self.d, self._mn(), self.bits)

    def _mn(self) -> torch.Tensor:
        return self.mn if self.mn is not None else _NONE_F16


_NONE = torch.empty(0)  # "no buffer" / "no offsets" for the extension
_NONE_F16 = torch.empty(0, dtype=torch.float16)


QuantizedWeight = Int8Weight | Int4Weight | BlockQuantWeight  # the packed LinearWeights


@dataclass
class GroupQuantized:
    """A GGUF Q4_0 / Q4_1 / Q8_0 matrix unpacked without loss: ``w = scale * (codes - offset) + bias`` per group.

    The arithmetic is that of gguf-py's ``dequantize_blocks`` (float32), so :meth:`dequantize` equals it bit for
    bit. Rows can be reordered or concatenated (whole rows with their scales) without changing that.

    Attributes:
        codes: [out, in] uint8 (4-bit: 0..15) or int8 (Q8_0).
        scale: [out, in // group_size] float32 (GGUF's fp16 ``d``, widened).
        bias: [out, in // group_size] float32 (Q4_1's ``m``) or None.
        offset: subtracted from the codes: 8 for Q4_0, else 0.
        bits: 4 or 8.
        group_size: input columns per group (32 for these types).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    offset: int
    bits: int
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.codes.shape)

    def kind(self) -> tuple[int, int, bool, int]:
        """What must match for two of these to be concatenated: (bits, offset, has bias, group size)."""
        return (self.bits, self.offset, self.bias is not None, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], bit-identical to gguf-py's dequantization."""
        out, k = self.shape
        q = self.codes.to(torch.int16) - self.offset if self.offset else self.codes
        q = q.float().view(out, k // self.group_size, self.group_size)
        w = self.scale[..., None] * q if self.bits == 4 else q * self.scale[..., None]
        if self.bias is not None:
            w = w + self.bias[..., None]
        return w.view(out, k)

    @staticmethod
    def cat_rows(parts: list[GroupQuantized]) -> GroupQuantized:
        """Stack matrices of the same :meth:`kind` along the output rows (fusing q/k/v or gate/up).

        Raises:
            ValueError: the parts differ in kind or input width.
        """
        if len({p.kind() for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("cannot concatenate GGUF tensors of different quantization types or widths")
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        first = parts[0]
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), bias,
                              first.offset, first.bits, first.group_size)


def pack_group_quantized(g: GroupQuantized, block_ext: Any = None) -> QuantizedWeight:
    """The packed weight holding ``g``'s codes unchanged: with ``block_ext`` (the compiled
    leanserve.kernels.native_ops()), a :class:`BlockQuantWeight`; else 4-bit -> :class:`Int4Weight` with
    scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0, whose offset is already 8); Q8_0 -> per-group
    :class:`Int8Weight`.

    Q4_1's ``w = d*q + m`` equals the kernel's ``(q - 8) * d + (m + 8d)``; the only change is the rounding of
    scale and zero to bf16 (relative 2**-8: for |q - 8| <= 8 at most 1/32 of a quantization step, plus 2**-8 |zero|).
    """
    if block_ext is not None and g.group_size == 32:
        return BlockQuantWeight.from_group(g, block_ext)
    if g.bits == 8:
        return Int8Weight(g.codes.to(torch.int8).contiguous(), g.scale.contiguous(), g.group_size)
    if g.offset == 8 and g.bias is None:
        zero = torch.zeros_like(g.scale)
    elif g.offset == 0 and g.bias is not None:
        zero = g.bias + 8 * g.scale
    else:
        raise ValueError(f"no int4 layout for offset {g.offset} with bias={g.bias is not None}")
    return Int4Weight.from_codes(g.codes, g.scale, zero, g.group_size)


def quantize_weight(w: torch.Tensor | GroupQuantized, method: str, group_size: int = 32, block_ext: Any = None
                    ) -> torch.Tensor | QuantizedWeight:
    """The weight a projection gets under ``method`` (see leanserve.quantization.QUANTIZATION_METHODS): a packed
    :class:`LinearWeight`, or a float tensor (the model wraps it in a :class:`FloatWeight` in its dtype).

    ``auto`` packs a :class:`GroupQuantized` natively and leaves float tensors alone; ``none`` dequantizes;
    ``int8`` / ``int4`` quantize from float, except that a 4-bit GGUF tensor with a matching group size is packed
    natively under ``int4`` (re-quantizing it could only lose).

    Raises:
        UnsupportedQuantizationError: unknown method, or a group size that does not divide the input width.
    """
    if method == "auto":
        return pack_group_quantized(w, block_ext) if isinstance(w, GroupQuantized) else w
    if method == "int4" and isinstance(w, GroupQuantized) and w.bits == 4 and w.group_size == group_size:
        return pack_group_quantized(w, block_ext)
    dense = w.dequantize() if isinstance(w, GroupQuantized) else w
    if method == "none":
        return dense
    if method == "int8":
        return Int8Weight.from_float(dense)
    if method == "int4":
        return Int4Weight.from_float(dense, group_size)
    raise UnsupportedQuantizationError("quantization", f"unsupported quantization {method!r}")


def _check_group_size(in_features: int, group_size: int) -> None:
    """Raises UnsupportedQuantizationError unless ``group_size`` divides ``in_features``."""
    if in_features % group_size:
        raise UnsupportedQuantizationError(
            "quantization_group_size", f"int4 group size {group_size} does not divide the input width {in_features}")
