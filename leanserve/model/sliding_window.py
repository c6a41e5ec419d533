"""Sliding-window (local) attention over the paged KV cache: each query sees only the last ``window`` keys.

The rule is transformers' (``masking_utils.sliding_window_overlay``, used by Gemma 2/3): a query at position ``q``
attends to the key at ``k`` iff ``q - window < k <= q`` (``window`` keys, itself included). Only the blocks that
hold such keys are read: :func:`sliding_window_metadata` cuts each sequence's block table to the blocks from
``(q - window + 1) // block_size`` on and builds the masks, once per step for all local layers;
:func:`sliding_window_attention` then runs ``scaled_dot_product_attention`` (torch path, float or int8 caches) on
them. The blocks before a sequence's window are never read, which is what a block manager needs to free them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leanserve.model.attention import (
    Q_ROWS_MULTIPLE,
    AttentionMetadata,
    KVCache,
    _gather,
    _padded_queries,
    write_kv,
)

import torch
import torch.nn.functional as F


@dataclass
class LocalDecodeGroup:
    """Decodes of one :class:`leanserve.model.attention.DecodeGroup` restricted to their windows."""

    start: int  # first token of the group in the flattened batch
    count: int
    block_table: torch.Tensor  # [count, width] int64: each row's blocks from its window's first block, 0-padded
    mask: torch.Tensor  # [count, 1, 1, width * block_size] bool, True = in the window


@dataclass
class LocalPrefill:
    """A prefill chunk with the keys of its window: cached blocks from ``first_block`` on, or its own K/V."""

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [n] int64: the sequence's blocks from first_block on (unused when context_len == 0)
    first_block: int
    mask: torch.Tensor | None  # [rows, keys] bool (rows padded to Q_ROWS_MULTIPLE, padding rows all True); None: causal


@dataclass
class SlidingWindowMetadata:
    """The local layers' view of one step (built from the step's :class:`AttentionMetadata`)."""

    slot_mapping: torch.Tensor
    decode_groups: list[LocalDecodeGroup] = field(default_factory=list)
    prefills: list[LocalPrefill] = field(default_factory=list)


def _rows(n: int) -> int:
    """Query rows of a chunk of ``n`` tokens once padded (see ``attention._padded_queries``)."""
    return -(-n // Q_ROWS_MULTIPLE) * Q_ROWS_MULTIPLE


def sliding_window_metadata(meta: AttentionMetadata, window: int, block_size: int) -> SlidingWindowMetadata:
    """Restrict ``meta``'s decodes and prefill chunks to ``window`` keys per query.

    Args:
        meta: the step's metadata (decode groups with ``seq_lens``; prefill chunks with their block tables). With
            ``meta.local_block_map``, block ids and slots are translated to the local layers' own pool (every
            block a window reads or a new token writes has a local block there: the KV cache manager pins them).
        window: keys each query sees, itself included (>= 1).
        block_size: tokens per KV block.

    Returns:
        block tables cut to the first block of each window, and boolean masks (True = attend).
    """
    out = SlidingWindowMetadata(slot_mapping=meta.slot_mapping)
    local_of = meta.local_block_map
    if local_of is not None:
        # a block without a local one is only the runner's cost probe (measure_decode_cost, at start, writing to
        # block 0 before any request holds a block): it writes local block 0, which its later owner overwrites
        out.slot_mapping = (local_of[meta.slot_mapping // block_size].clamp(min=0) * block_size
                            + meta.slot_mapping % block_size)

    def local(blocks: torch.Tensor) -> torch.Tensor:  # block ids in the local pool (padding / masked ones: 0)
        return blocks if local_of is None else local_of[blocks].clamp(min=0)
    for g in meta.decode_groups:
        lens = g.seq_lens  # [count]: the query is at lens - 1
        dev = lens.device
        first = (lens - window).clamp(min=0) // block_size  # [count]
        nblocks = (lens + block_size - 1) // block_size - first
        width = int(nblocks.max())
        idx = (first[:, None] + torch.arange(width, device=dev)[None, :]).clamp(max=g.block_table.shape[1] - 1)
        table = local(g.block_table.gather(1, idx))
        key = first[:, None] * block_size + torch.arange(width * block_size, device=dev)[None, :]
        mask = (key < lens[:, None]) & (key >= lens[:, None] - window)
        out.decode_groups.append(LocalDecodeGroup(g.start, g.count, table, mask.view(g.count, 1, 1, -1)))
    for p in meta.prefills:
        dev = p.block_ids.device
        ctx, n = p.context_len, p.query_len
        rows = _rows(n)
        if ctx == 0:
            mask = None
            if n > window:
                q = torch.arange(rows, device=dev)[:, None]
                k = torch.arange(n, device=dev)[None, :]
                mask = (k <= q) & (k > q - window)
                mask[n:] = True
            out.prefills.append(LocalPrefill(p.query_start, n, 0, p.block_ids, 0, mask))
            continue
        first = max(0, ctx - window + 1) // block_size
        q = torch.arange(ctx, ctx + rows, device=dev)[:, None]
        k = torch.arange(first * block_size, ctx + n, device=dev)[None, :]
        mask = (k <= q) & (k > q - window)
        mask[n:] = True
        out.prefills.append(LocalPrefill(p.query_start, n, ctx, local(p.block_ids[first:]), first, mask))
    return out


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                             local: SlidingWindowMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's tokens over the last ``window`` keys of their sequences.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied). k, v: [T, kv_heads, head_dim] new keys/values
            (written to the cache here, at ``local.slot_mapping``).
        k_cache, v_cache: this layer's cache, [num_blocks, block_size, kv_heads, head_dim].
        local: from :func:`sliding_window_metadata`.
        scale: the softmax scale (e.g. ``query_pre_attn_scalar**-0.5``).

    Returns:
        [T, num_heads, head_dim].
    """
    write_kv(k_cache, v_cache, k, v, local.slot_mapping)
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype != k.dtype:
        k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    gqa = num_heads // kv_heads
    out = torch.empty_like(q)
    for g in local.decode_groups:
        sl = slice(g.start, g.start + g.count)
        qd = q[sl].view(g.count, kv_heads, gqa, head_dim)
        kd = _gather(k_cache, g.block_table, q.dtype)  # [count, kv_heads, width * block_size, head_dim]
        vd = _gather(v_cache, g.block_table, q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out[sl] = od.reshape(g.count, num_heads, head_dim)
    for p in local.prefills:
        sl = slice(p.query_start, p.query_start + p.query_len)
        qp = _padded_queries(q[sl])
        if p.context_len == 0:
            kp = k[sl].transpose(0, 1).unsqueeze(0)
            vp = v[sl].transpose(0, 1).unsqueeze(0)
        else:
            keys = p.context_len + p.query_len - p.first_block * k_cache.shape[1]
            kp = _gather(k_cache, p.block_ids, q.dtype)[:, :keys].unsqueeze(0)
            vp = _gather(v_cache, p.block_ids, q.dtype)[:, :keys].unsqueeze(0)
        if p.mask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=scale)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True, scale=scale)
        out[sl] = op[0, :, : p.query_len].transpose(0, 1)
    return out
