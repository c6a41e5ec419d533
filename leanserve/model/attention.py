"""Attention over a paged KV cache (PagedAttention, Kwon et al., SOSP 2023), in plain PyTorch for CPU and GPU.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the layout
of vLLM's flash backend): gathering a sequence's blocks is one ``index_select`` on dim 0, and the result is
used through a strided view, without a second copy. Tokens of a
step are flattened: the first ``num_decodes`` tokens are decodes (one new token per sequence), the rest are
prefill chunks, one contiguous run of tokens per sequence.

* Decodes run as batched ``scaled_dot_product_attention`` calls, one per group of sequences of similar length
  (the runner sorts decodes by length and groups them so padding stays small): each sequence's blocks are gathered
  through its block table into ``[group, kv_heads, max_len, head_dim]`` and padding keys are masked out. The
  query heads that share a KV head (GQA) are laid out as that head's queries, so no KV head is repeated.
* With the native kernel (``leanserve/kernels/paged_attention.cpp``, float32 on CPU) all decodes are one call that
  reads each sequence's blocks in place, with no gather and no padding.
* New keys and values go into the cache through the slot mapping: on CPU (float32 or float16 cache) one native
  call per layer (``write_kv_``, ``leanserve/kernels/kv_write.cpp``, also the fused decode's KV write), else
  ``index_copy_``; the stored bits are the same.
* An int8 KV cache (:class:`leanserve.quantization.kv_cache.Int8KVCache`) is written quantized and read through
  the torch path: only the gathered blocks are dequantized, to the query dtype (the native kernel is fp32-only).
* Each prefill chunk is one call: with no earlier context its own K/V are used with a causal mask; after a
  prefix-cache hit or an earlier chunk, the context is gathered from the cache and the causal mask is offset.
* With the native prefill kernel (``leanserve/kernels/prefill_attention.cpp``, an fp32 cache on CPU; see
  :mod:`leanserve.model.prefill_attention`) each chunk is one call that reads its sequence's blocks through the
  block table (converted once per call into the kernel's packed operand copy), with no torch gather, mask or query
  padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from leanserve.kernels import native_ops
from leanserve.quantization.kv_cache import Int8KVCache

import torch
import torch.nn.functional as F

KVCache = torch.Tensor | Int8KVCache  # one layer's K or V: [num_blocks, block_size, kv_heads, head_dim]

# Prefill chunks of at least this many tokens give every row bitwise the same result whatever the chunk's length
# and context (a 1-token piece would run as a decode, and NumPy's BLAS rounds 1-2-row products differently; the
# SDPA path's query padding, _padded_queries, does the rest; the native prefill kernel needs no padding: each of
# its rows is computed alike whatever the chunk): the engine keeps prefix-cache tails and chunked-prefill
# pieces at least this long, so a prompt's output does not depend on what was cached or how it was chunked
# (tests/engine/test_prefix_cache_exact.py).
PREFILL_MIN_ROWS = 8
Q_ROWS_MULTIPLE = 32  # prefill queries are padded to a multiple of this many rows (see _padded_queries)


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flattened batch."""

    query_start: int  # index of the chunk's first token in the flattened batch
    query_len: int  # tokens in this chunk
    context_len: int  # tokens of the sequence already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks_of_sequence] int64: the sequence's block table
    # [rows, context_len + query_len] bool, True = attend; rows = query_len, or query_len rounded up to
    # Q_ROWS_MULTIPLE with the padding rows attending to every key; None if no context
    mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Consecutive single-token decodes of similar length, attended in one batched call."""

    start: int  # index of the group's first token in the flattened batch
    count: int  # sequences (= tokens) in the group
    block_table: torch.Tensor  # [count, max_blocks] int64, padded with block 0
    seq_lens: torch.Tensor  # [count] int64: tokens each sequence attends to (the new one included)
    mask: torch.Tensor | None  # [count, 1, 1, max_blocks * block_size] bool, True = attend (torch path only)


@dataclass
class AttentionMetadata:
    """Everything a layer needs to write and read the paged KV cache for one step (shared by all layers)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token's K/V
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the leading decode tokens, in groups
    prefills: list[PrefillChunk] = field(default_factory=list)
    # (start, stop) row ranges of the prefill chunks that hold generated tokens recomputed after a preemption: the
    # matmuls compute them as decode rows (LinearWeight.matmul's recomputed_rows)
    recomputed_rows: list[tuple[int, int]] = field(default_factory=list)
    # native paged decode kernel (leanserve.kernels), reading the cache in place; None: the torch path
    decode_kernel: Callable[..., torch.Tensor] | None = None
    # native paged prefill attention (leanserve.model.prefill_attention): each chunk read in place from an fp32
    # cache, no mask, no query padding; None: the torch path
    prefill_kernel: Callable[..., torch.Tensor] | None = None
    # sliding-window layers with their own smaller pool: [num_blocks] int64, the local block of each block id
    # (-1: none; leanserve.core.sliding_window); None: they use the block ids as they are
    local_block_map: torch.Tensor | None = None

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the leading decodes (one per sequence); the rest of the batch is prefill."""
        return sum(g.count for g in self.decode_groups)


def write_kv(k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ([T, kv_heads, head_dim]) in the cache slots ``slot_mapping`` ([T] int64), converted
    to the cache's dtype. A float32 or float16 cache on CPU with float32 keys is written by one native call
    (``write_kv_``, leanserve/kernels/kv_write.cpp), bitwise what the torch path (``index_copy_`` of
    ``k.to(cache dtype)``) stores; an int8 cache quantizes (:meth:`Int8KVCache.write`)."""
    if isinstance(k_cache, Int8KVCache):
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    native = _native_kv_write(k_cache, k, v)
    if native is not None:
        native(k, v, k_cache, v_cache, slot_mapping)
        return
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _native_kv_write(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[..., None] | None:
    """The native ``write_kv_`` where it applies (CPU, float32 keys and values with contiguous heads, a contiguous
    float32 / float16 cache), else None (the torch path: no native kernels, CUDA, other dtypes or layouts)."""
    if (k_cache.device.type != "cpu" or k_cache.dtype not in _NATIVE_CACHE_DTYPES or k.dtype != torch.float32
            or v.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous()):
        return None
    ext = native_ops()
    return getattr(ext, "write_kv_", None) if ext is not None else None


_NATIVE_CACHE_DTYPES = (torch.float32, torch.float16)


def _gather(cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values of the blocks ``block_ids`` ([..., n] int64) as a [..., kv_heads, n * block_size, head_dim]
    strided view of one gathered copy (converted to ``dtype``; dequantized for an int8 cache)."""
    _, block_size, kv_heads, head_dim = cache.shape
    lead = block_ids.shape[:-1]
    if isinstance(cache, Int8KVCache):
        blocks = cache.gather(block_ids, dtype)
    else:  # [prod(lead) * n, block_size, kv_heads, head_dim]
        blocks = cache.index_select(0, block_ids.reshape(-1)).to(dtype)
    blocks = blocks.view(*lead, block_ids.shape[-1] * block_size, kv_heads, head_dim)
    return blocks.transpose(-3, -2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache,
                    v_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Causal self-attention of the step's tokens over their sequences' cached and new keys/values.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied).
        k, v: [T, kv_heads, head_dim] new keys/values; written to the cache here.
        k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] this layer's KV cache (float, or int8).
        meta: step metadata (slot mapping, decode block tables, prefill chunks).

    Returns:
        [T, num_heads, head_dim] attention output, scaled by 1/sqrt(head_dim).
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if (isinstance(k_cache, torch.Tensor) and k_cache.dtype != k.dtype and meta.prefill_kernel is None
            and any(p.context_len == 0 for p in meta.prefills)):
        # a float16 cache and a chunk that attends to its own new keys/values (the torch prefill path; every other
        # path reads them from the cache): them as the cache holds them, so a token's attention reads the same
        # values whether its context was computed in this step, an earlier chunk or came from the prefix cache
        k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if meta.decode_kernel is not None and not meta.prefills and len(meta.decode_groups) == 1:  # decode-only step
        g = meta.decode_groups[0]
        return meta.decode_kernel(q.contiguous(), k_cache, v_cache, g.block_table, g.seq_lens, head_dim ** -0.5)
    out = torch.empty_like(q)
    gqa = num_heads // kv_heads
    for g in meta.decode_groups:
        sl = slice(g.start, g.start + g.count)
        if meta.decode_kernel is not None:
            out[sl] = meta.decode_kernel(q[sl].contiguous(), k_cache, v_cache, g.block_table, g.seq_lens,
                                         head_dim ** -0.5)
            continue
        qd = q[sl].view(g.count, kv_heads, gqa, head_dim)  # GQA group as that KV head's queries
        kd = _gather(k_cache, g.block_table, q.dtype)  # [count, kv_heads, max_len, head_dim]
        vd = _gather(v_cache, g.block_table, q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask)
        out[sl] = od.reshape(g.count, num_heads, head_dim)
    for p in meta.prefills:
        sl = slice(p.query_start, p.query_start + p.query_len)
        if meta.prefill_kernel is not None:
            meta.prefill_kernel(q[sl], k_cache, v_cache, p.block_ids, p.context_len, head_dim ** -0.5, out=out[sl])
            continue
        qp = _padded_queries(q[sl])  # [1, num_heads, q_len rounded up to Q_ROWS_MULTIPLE, head_dim]
        if p.context_len == 0:
            kp = k[sl].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, head_dim]
            vp = v[sl].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            kv_len = p.context_len + p.query_len
            kp = _gather(k_cache, p.block_ids, q.dtype)[:, :kv_len].unsqueeze(0)  # [1, kv_heads, kv_len, head_dim]
            vp = _gather(v_cache, p.block_ids, q.dtype)[:, :kv_len].unsqueeze(0)
            mask = p.mask  # the runner builds it with the padding rows already
            if mask.shape[0] < qp.shape[2]:
                mask = torch.cat([mask, mask.new_ones(qp.shape[2] - mask.shape[0], kv_len)])  # padding rows: any
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
        out[sl] = op[0, :, : p.query_len].transpose(0, 1)
    return out


def _padded_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries [n, heads, head_dim] as a contiguous [1, heads, m, head_dim] copy, zero rows appended up to
    m = n rounded up to ``Q_ROWS_MULTIPLE``.

    torch's CPU flash attention splits the queries into blocks of 32, 64 or 256 rows, and a block of fewer than
    4 rows rounds differently; with whole multiples of 32 rows every block is full, so a query row's result does
    not depend on how long its chunk was (a prefix-cache tail equals the cold prefill bitwise). Padding rows attend
    to valid keys (causal: the first ones) and are dropped.
    """
    n, heads, head_dim = q.shape
    m = -(-n // Q_ROWS_MULTIPLE) * Q_ROWS_MULTIPLE
    out = q.new_zeros(1, heads, m, head_dim)
    out[0, :, :n] = q.transpose(0, 1)
    return out
