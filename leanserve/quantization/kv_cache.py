"""The int8 KV cache: symmetric int8 values with one float32 scale per token and KV head.

A cache tensor of one layer (K or V) is an :class:`Int8KVCache`: ``data`` [num_blocks, block_size, kv_heads,
head_dim] int8 and ``scale`` [num_blocks, block_size, kv_heads] float32, with ``x = data * scale`` and
``scale = max|x| / 127`` over the head dim of that token and head (per-token, per-head symmetric quantization as in
KIVI / vLLM's per-token-head int8 KV). Attention gathers a sequence's blocks of both and dequantizes only those
(``leanserve.model.attention``). Per token and layer that is ``2 * kv_heads * (head_dim + 4)`` bytes: for head dim
64, 3.76x fewer than fp32 (1.88x fewer than bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from leanserve.config import ModelConfig
from leanserve.quantization import check_kv_cache_dtype
from leanserve.quantization.anon_memory import anonymous_zeros, prefault

import torch

SCALE_BYTES = 4  # float32 scale per token and KV head
_ELEMENT_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An all-zero tensor of ``shape`` and ``dtype`` on ``device``: a KV cache pool.

    On CPU it is its own anonymous memory mapping (:func:`leanserve.quantization.anon_memory.anonymous_zeros`):
    zero by contract, mapped lazily by the kernel, so a pool costs no time and no resident memory until its blocks
    are first written (``torch.zeros`` writes every byte at allocation), 2 MiB aligned with transparent huge pages
    asked for (``MADV_HUGEPAGE``), whatever malloc's settings; unmapped when the tensor is freed. Elsewhere
    ``torch.zeros``.
    """
    if torch.device(device).type == "cpu":
        return anonymous_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def prefault_pool(caches: list[tuple[torch.Tensor | Int8KVCache, torch.Tensor | Int8KVCache]]) -> int:
    """Makes every layer's K and V pool resident (:func:`leanserve.quantization.anon_memory.prefault`: contents
    unchanged; call before serving starts) and returns the bytes covered."""
    total = 0
    for pair in caches:
        for c in pair:
            for t in (c.data, c.scale) if isinstance(c, Int8KVCache) else (c,):
                prefault(t)
                total += t.numel() * t.element_size()
    return total


@dataclass
class Int8KVCache:
    """One layer's K or V cache in int8 (see the module docstring).

    Attributes:
        data: [num_blocks, block_size, kv_heads, head_dim] int8.
        scale: [num_blocks, block_size, kv_heads] float32.
    """

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
              device: torch.device | str = "cpu") -> Int8KVCache:
        """An all-zero cache (padding slots read as exact zeros)."""
        return cls(zeroed((num_blocks, block_size, kv_heads, head_dim), torch.int8, device),
                   zeroed((num_blocks, block_size, kv_heads), torch.float32, device))

    @property
    def shape(self) -> torch.Size:
        """[num_blocks, block_size, kv_heads, head_dim], like a float cache."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales."""
        return self.data.numel() + self.scale.numel() * SCALE_BYTES

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize new keys or values x [T, kv_heads, head_dim] (float) into slots ``slot_mapping`` [T] int64."""
        num_blocks, block_size, kv_heads, head_dim = self.data.shape
        q, scale = quantize_per_token_head(x)
        self.data.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, q)
        self.scale.view(num_blocks * block_size, kv_heads).index_copy_(0, slot_mapping, scale)

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The blocks ``block_ids`` ([..., n] int64) dequantized: [..., n, block_size, kv_heads, head_dim]."""
        flat = block_ids.reshape(-1)
        data = self.data.index_select(0, flat)  # [prod(lead) * n, block_size, kv_heads, head_dim] int8
        scale = self.scale.index_select(0, flat)  # [prod(lead) * n, block_size, kv_heads]
        out = data.to(dtype) * scale.to(dtype).unsqueeze(-1)
        return out.view(*block_ids.shape, *self.data.shape[1:])


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: x [..., head_dim] float -> (codes [..., head_dim] int8, scale [...] fp32)
    with ``x ~= codes * scale``, ``scale = max|x| / 127`` (0-rows get scale 0 and code 0); the rounding error is at
    most ``scale / 2`` per element."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "auto", model_dtype: str = "float32") -> int:
    """Bytes one token takes in the KV cache over all layers: ``2 x layers x kv_heads x head_dim x bytes``
    (+ a float32 scale per token and KV head for int8). ``kv_cache_dtype`` "auto" means ``model_dtype``
    ("float32", "float16" or "bfloat16"); "float16" is 2 bytes per element.

    Raises:
        UnsupportedQuantizationError: unknown ``kv_cache_dtype``. KeyError: unknown ``model_dtype``.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    per_head = (config.head_dim + SCALE_BYTES if kv_cache_dtype == "int8"
                else config.head_dim * _ELEMENT_BYTES["float16" if kv_cache_dtype == "float16" else model_dtype])
    return 2 * config.num_layers * config.num_kv_heads * per_head
