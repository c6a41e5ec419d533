"""Weight-only quantized matrices and their matmuls (gpt-fast style: the model swaps a float weight for one of these).

* :class:`Int8Weight` -- int8 codes with a scale per output row (symmetric per channel), or per group of input
  columns (GGUF Q8_0: groups of 32).
* :class:`Int4Weight` -- 4-bit codes in torch's CPU packed layout with a scale and a zero point per group of
  32, 64 or 128 input columns: ``w = (q - 8) * scale + zero`` (the convention of ``_weight_int4pack_mm_for_cpu``).
* :class:`BlockQuantWeight` -- a GGUF Q4_0 / Q4_1 / Q8_0 matrix in its file layout (codes + fp16 scales) for
  leanserve's own kernel (``leanserve/kernels/block_quant_gemm.cpp``): fp32 activations and output, exact weights.
* :class:`GroupQuantized` -- the exact, unpacked form of a GGUF Q4_0 / Q4_1 / Q8_0 tensor as the loader reads it;
  :func:`pack_group_quantized` turns it into one of the above without re-quantizing.

Kernel choice (measured on this 2-core AVX2 CPU, see ``benchmarks/quant.py`` and ``../shared/MACHINE-NOTES.md``):
torch's ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` are fast only with bf16 activations, and with
bf16 activations they were as fast as or faster than the fp32 BLAS GEMM at every batch size measured (1..512 rows;
e.g. a 3072x576 matrix at 32 rows: int4 3.4 ms, int8 4.4 ms, fp32 ~35 ms under load). So activations are rounded
to bf16 for the packed kernels at every batch size, and their bf16 output is returned as float32. Per-group int8
(Q8_0) has no torch kernel: it is dequantized per call (correct, memory-saving, slow).

Numerics: scales and zero points are stored in bf16 (the kernels require it), and quantization from float rounds
them to bf16 *before* choosing the codes, so :meth:`dequantize` is exactly what the kernel multiplies by. The matmul
then differs from ``x @ dequantize().T`` in fp32 only by the bf16 rounding of the activations and of the output
(unit roundoff 2**-8 each): ``|y - ref| <= 2**-7 * (|x| @ |W|.T)`` elementwise, up to fp32 summation error.
:class:`BlockQuantWeight` is much closer: its kernel rounds activations to int16 per block of 32 (2**-16 of the
block's largest value) and accumulates in exact int32 and fp32; over 32 greedy decode steps of the default model
its largest log-probability difference to the dequantized fp32 model is 0.002, against 0.03 with torch's kernels
(tests/quantization/test_quality.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leanserve.errors import UnsupportedQuantizationError
from leanserve.quantization.int4_pack import pack_int4, unpack_int4

import torch


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

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x [M, in] float: [M, out] in x's dtype (see the module notes on precision)."""
        if self.group_size == self.shape[1]:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scales)
            return y.to(x.dtype)
        return torch.nn.functional.linear(x.float(), self.dequantize()).to(x.dtype)


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
        """The codes [out, in] uint8 (0..15), unpacked. Raises ValueError when ``out % 64`` (see int4_pack)."""
        return unpack_int4(self.packed)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix the kernel multiplies by. Raises ValueError when ``out % 64``."""
        out, k = self.shape
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
        q = self.codes().float().view(out, k // self.group_size, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(out, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x [M, in] float: [M, out] in x's dtype (see the module notes on precision)."""
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)


# Rows up to which a BlockQuantWeight in file layout (an output width not divisible by 64) runs its block kernel;
# above, it dequantizes to fp32 and runs the BLAS GEMM. Measured on a 2-core AVX2 CPU for a 3072x576 matrix (2
# threads): kernel vs dequantize + GEMM 0.94/1.23 ms at 32 rows, 1.60/1.47 ms at 48, 15.5/10.0 at 512.
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
    * file layout (other widths): ``block_quant_gemm`` up to :data:`BLOCK_KERNEL_MAX_ROWS` rows (the same
      arithmetic), above that dequantize to fp32 and the float GEMM.

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
    """

    codes: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None
    bits: int
    ext: Any
    scratch: torch.Tensor | None = None
    lanes: bool = False

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

        # [tile, group, lane, b, p, i] -> [tile, b, group, p, lane, i]
        codes = self.codes.view(out // 64, 8, 8, nb, pairs, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
        return BlockQuantWeight(codes, scales(self.d), scales(self.mn), self.bits, self.ext, self.scratch, lanes=True)

    def _file_rows(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, d and mn (or an empty fp16 tensor) of the rows ``ids`` (None: all) in file layout."""
        if not self.lanes:
            if ids is None:
                return self.codes, self.d, self._mn()
            mn = self.mn[ids].contiguous() if self.mn is not None else _NONE_F16
            return self.codes[ids].contiguous(), self.d[ids].contiguous(), mn
        out, _ = self.shape
        ids = torch.arange(out) if ids is None else ids
        t, g, lane = ids // 64, ids // 8 % 8, ids % 8
        codes = self.codes[t, :, g, :, lane, :].reshape(len(ids), -1)  # [T, blocks, P, 2] -> the file's row bytes
        mn = self.mn[t, :, g, lane].contiguous() if self.mn is not None else _NONE_F16
        return codes.contiguous(), self.d[t, :, g, lane].contiguous(), mn

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

    def matmul(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """``x @ w.T`` for x [M, in] float: [M, out] float32. ``row_invariant`` keeps the kernel at every M, so a
        row's result never depends on how many rows came with it (batch-invariant mode; always so in lane
        layout)."""
        x = x.float()
        if self.lanes or row_invariant or x.shape[0] <= BLOCK_KERNEL_MAX_ROWS:
            return self.kernel(x)
        return torch.nn.functional.linear(x, self.dequantize())

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` through the lane or block kernel at any M: x [M, in] float32, returns [M, out] float32."""
        if self.lanes:
            return self.ext.lane_quant_gemm(x.contiguous(), self.codes, self.d, self._mn(), self.bits)
        return self.ext.block_quant_gemm(x.contiguous(), self.codes, self.d, self._mn(), self.bits)

    def _mn(self) -> torch.Tensor:
        return self.mn if self.mn is not None else _NONE_F16


_NONE = torch.empty(0)  # "no buffer" / "no offsets" for the extension
_NONE_F16 = torch.empty(0, dtype=torch.float16)


QuantizedWeight = Int8Weight | Int4Weight | BlockQuantWeight


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
    """The weight ``linear`` will use under ``method`` (see leanserve.quantization.QUANTIZATION_METHODS).

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
