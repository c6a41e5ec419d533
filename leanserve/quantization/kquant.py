"""GGUF K-quant matrices (Q4_K, Q6_K) kept in their file bytes and multiplied by leanserve's native kernel.

:class:`KQuantWeight` is a :class:`leanserve.quantization.weights.LinearWeight`: ``kquant_gemm``
(``leanserve/kernels/kquant_gemm.cpp``) dequantizes one 256-weight super-block at a time into L1 and dots it with
fp32 activations, so a decode step reads 4.5 (Q4_K) or 6.56 (Q6_K) bits per weight instead of 32. The kernel's
choice per row follows the file-layout :class:`BlockQuantWeight`: the first ``kernel_rows`` rows (decode tokens)
run it while there are at most :data:`BLOCK_KERNEL_MAX_ROWS`; prefill rows are dequantized and run the fp32 GEMM,
so a prompt token's result does not depend on how it was chunked. Dequantization is ggml's arithmetic, equal to
``gguf.quants.dequantize`` bit for bit (tests/gemma/test_gemma3_kquant.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leanserve.quantization.weights import BLOCK_KERNEL_MAX_ROWS, FloatWeight, RowRanges

import numpy as np
import torch

Q4_K, Q6_K = 12, 14  # GGML type ids
TYPE_SIZE = {Q4_K: 144, Q6_K: 210}  # bytes per super-block of 256 weights
QK_K = 256


@dataclass
class KQuantWeight:
    """A Q4_K or Q6_K matrix [out, in] as the file's bytes.

    Attributes:
        data: [out, in // 256 * TYPE_SIZE[qtype]] uint8, one file row per output.
        qtype: :data:`Q4_K` or :data:`Q6_K`.
        ext: the compiled extension (``leanserve.kernels.native_ops()``), or None: only :meth:`dequantize` works
            (through gguf-py), and the model uses the float matrix.
    """

    data: torch.Tensor
    qtype: int
    ext: Any = None

    def __post_init__(self) -> None:
        if self.qtype not in TYPE_SIZE:
            raise ValueError(f"not a K-quant type id: {self.qtype}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] % TYPE_SIZE[self.qtype]:
            raise ValueError(f"K-quant data must be [out, blocks * {TYPE_SIZE[self.qtype]}] uint8")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.data.shape[0], self.data.shape[1] // TYPE_SIZE[self.qtype] * QK_K)

    @property
    def nbytes(self) -> int:
        """Bytes of the file's blocks (Q4_K: 4.5 bits per weight, Q6_K: 6.5625)."""
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] matrix (ggml's arithmetic, equal to gguf-py's)."""
        if self.ext is not None:
            return self.ext.kquant_dequantize(self.data, self.qtype)
        import gguf

        flat = gguf.quants.dequantize(self.data.numpy().reshape(-1), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32).reshape(self.shape))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` through ``kquant_gemm``: x [M, in] float32 -> [M, out] float32."""
        return self.ext.kquant_gemm(x.contiguous(), self.data, self.qtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, kernel_rows: int | None = None,
               invariant_rows: int = 0, recomputed_rows: RowRanges = ()) -> torch.Tensor:
        """``x @ w.T + bias``: x [T, in] -> [T, out] in x's dtype (computed in float32). The kernel on the first
        ``kernel_rows`` rows (None: all) when at most :data:`BLOCK_KERNEL_MAX_ROWS`, else on none; dequantize +
        the fp32 GEMM on the others; every row through the kernel with ``invariant_rows``."""
        t = x.shape[0]
        n = t if kernel_rows is None or invariant_rows else kernel_rows
        if n > BLOCK_KERNEL_MAX_ROWS and not invariant_rows:
            n = 0
        if self.ext is None:
            n = 0
        xf = x if x.dtype == torch.float32 else x.float()
        if n == t:
            y = self.kernel(xf)
        elif n == 0:
            y = FloatWeight(self.dequantize()).matmul(xf)
        else:
            y = torch.cat([self.kernel(xf[:n]), FloatWeight(self.dequantize()).matmul(xf[n:])])
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if bias is None else y + bias
