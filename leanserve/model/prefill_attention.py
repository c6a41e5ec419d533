"""The native paged prefill attention kernel (``leanserve/kernels/prefill_attention.cpp``) as the runner uses it.

A prefill chunk's causal attention over an fp32 (or fp16, widened per call) paged KV cache, read through the
sequence's block table (flash attention over one cache block of keys at a time; the chunk's blocks packed once per
call into the dot products' operand layout, no mask tensor). Its precision follows ``--prefill-gemm``: the bf16 mode
(products of bf16-rounded operands with fp32 accumulation, AVX512_BF16) when the prefill GEMMs run in bf16, fp32
otherwise, so that ``lane`` and ``bf16x3`` keep fp32-close prompt numbers; the bf16 mode's products run on AMX tiles
when the bf16 GEMM does (``resolve_bf16_engine``). The two bf16 engines round Q, K and V alike but sum in another
order, and at block sizes below 64 the AMX path's online softmax steps over 64 keys, not one block, so P is rounded
to bf16 against other running maxima: their outputs then differ at the level of bf16's rounding of P, not only in
the last bits, each as far from fp32 as the other (tests/kernels/test_prefill_attention.py). A query row's result is
bitwise independent of its chunk's length and start and of where its context came from (see the kernel's notes).
"""

from __future__ import annotations

from typing import Any

import torch

# head sizes with the kernel's SIMD paths (other sizes would run its scalar loops, slower than SDPA)
KERNEL_HEAD_DIMS = (64, 128)


class PrefillAttentionKernel:
    """``kernel(q, k_cache, v_cache, block_ids, context_len, scale, out=None)`` -> [n, num_heads, head_dim] float32.

    Args (of a call): q [n, num_heads, head_dim] float32 (RoPE applied; row i at position context_len + i), read
    in place when each row's heads are contiguous (the q columns of the fused qkv product), else copied; k_cache,
    v_cache [num_blocks, block_size, kv_heads, head_dim] float32, or float16 (the blocks the chunk reads are then
    gathered and widened to float32 first), with the chunk's K/V already written;
    block_ids [>= ceil((context_len + n) / block_size)] int64; scale (1/sqrt(head_dim)); out, an optional
    [n, num_heads, head_dim] float32 tensor the result is written into (and returned).
    Raises RuntimeError (from the extension) on shapes or dtypes outside that contract.

    Attributes:
        bf16: whether the bf16 dot-product path runs (else fp32).
        engine: the bf16 path's engine, ``avx512_bf16`` or ``amx`` (the kernel's ``engine`` argument).
    """

    __slots__ = ("ext", "bf16", "engine")

    def __init__(self, ext: Any, bf16: bool, engine: str = "avx512_bf16") -> None:
        self.ext, self.bf16, self.engine = ext, bf16, engine

    def describe(self) -> str:
        """What runs, for the server's start line: ``native bf16 on amx``, ``native bf16 on avx512_bf16`` or
        ``native fp32``."""
        return f"native bf16 on {self.engine}" if self.bf16 else "native fp32"

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                 context_len: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        if q.dim() != 3 or (out is not None and out.dim() != 3):
            raise RuntimeError("paged_prefill_attention: q and out [n, H, D]")
        if k_cache.dtype == torch.float16:  # the blocks the chunk reads, widened once (as the SDPA path gathers)
            used = _blocks_to_gather(q, k_cache, block_ids, context_len)  # the kernel's own errors, checked first
            ids = block_ids[:used]
            k_cache, v_cache = k_cache.index_select(0, ids).float(), v_cache.index_select(0, ids).float()
            block_ids = torch.arange(used, dtype=torch.int64)
        if not _rows_dense(q):
            q = q.contiguous()
        if out is not None and not _rows_dense(out):
            out[:] = self.ext.paged_prefill_attention(q, k_cache, v_cache, block_ids, context_len, scale, self.bf16,
                                                      engine=self.engine)
            return out
        return self.ext.paged_prefill_attention(q, k_cache, v_cache, block_ids, context_len, scale, self.bf16, out,
                                                self.engine)


def _blocks_to_gather(q: torch.Tensor, k_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> int:
    """How many of ``block_ids`` a float16 chunk reads (ceil((context_len + n) / block_size)). Raises the kernel's
    RuntimeError for a table the gather cannot read (wrong dtype, too short, ids out of range), which index_select
    would otherwise report as an IndexError or hide behind the gathered table."""
    if k_cache.dim() != 4 or k_cache.shape[1] <= 0:
        raise RuntimeError("paged_prefill_attention: caches [blocks, block_size, KVH, D] with block_size and KVH > 0")
    if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
        raise RuntimeError("paged_prefill_attention: int64 block ids")
    if context_len < 0:
        raise RuntimeError("paged_prefill_attention: context_len >= 0")
    used = -(-(context_len + q.shape[0]) // k_cache.shape[1])
    if block_ids.shape[0] < used:
        raise RuntimeError("paged_prefill_attention: the block table does not cover context_len + n tokens")
    if used:
        lo, hi = torch.aminmax(block_ids[:used])
        if int(lo) < 0 or int(hi) >= k_cache.shape[0]:
            raise RuntimeError("paged_prefill_attention: block id out of range")
    return used


def _rows_dense(x: torch.Tensor) -> bool:
    """Whether each row of ``x`` [n, H, D] holds its H * D values contiguously (any row stride), as the kernel
    reads q and writes out."""
    n, heads, head_dim = x.shape
    return x.stride(2) == 1 and x.stride(1) == head_dim and (n <= 1 or x.stride(0) >= heads * head_dim)


def prefill_attention_kernel(ext: Any, head_dim: int, block_size: int, prefill_gemm: str,
                             gemm_engine: str | None = None) -> PrefillAttentionKernel | None:
    """The kernel for a model's fp32 or fp16 KV cache on CPU, or None where the torch path should run: no native
    kernels (``ext`` None or without the kernel), a head size outside ``KERNEL_HEAD_DIMS``, or a block size that is
    not a multiple of 16. ``prefill_gemm`` is the resolved ``--prefill-gemm`` mode: ``bf16`` selects the bf16 path
    where the build has AVX512_BF16 (``ext.prefill_attention_bf16_simd()``), anything else the fp32 path;
    ``gemm_engine`` (``prefill_gemm_engine``) ``amx`` puts the bf16 path on AMX tiles too."""
    if ext is None or not hasattr(ext, "paged_prefill_attention"):
        return None
    if head_dim not in KERNEL_HEAD_DIMS or block_size % 16:
        return None
    bf16 = prefill_gemm == "bf16" and bool(ext.prefill_attention_bf16_simd())
    on_amx = bf16 and gemm_engine == "amx" and amx_takes(ext, block_size)
    return PrefillAttentionKernel(ext, bf16, "amx" if on_amx else "avx512_bf16")


def amx_takes(ext: Any, block_size: int) -> bool:
    """Whether the kernel's AMX path runs this block size (``ext.prefill_attention_amx_takes``, the kernel's own
    rule: its key unit a multiple of 32 keys and at most 128); other block sizes run the AVX512_BF16 path. False
    without the native kernels."""
    return ext is not None and bool(ext.prefill_attention_amx_takes(block_size))
