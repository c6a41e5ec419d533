"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" layout.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021); the llama3
frequency scaling follows Meta's Llama 3.1 reference (as implemented in HF ``_compute_llama3_parameters``).
"""

from __future__ import annotations

import math
from typing import Any

from leanserve.errors import ModelLoadError

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding and the attention scaling factor for cos/sin.

    Args:
        head_dim: size of one attention head (elements); must be even.
        theta: RoPE base.
        scaling: HF-style ``rope_scaling`` dict or None. Supported ``rope_type``: default, linear, llama3.

    Returns:
        (inv_freq [head_dim // 2] float32, attention_factor): cos/sin are multiplied by attention_factor.

    Raises:
        ModelLoadError: for a scaling type leanserve does not implement.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ModelLoadError(f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by absolute token position.

    Args:
        head_dim: elements per head.
        max_position: number of positions to precompute (tokens).
        theta, scaling: see :func:`rope_inv_freq`.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.cos = emb.cos() * attention_factor
        self.sin = emb.sin() * attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` ([T] int64), each [T, 1, head_dim] in ``dtype``."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, head_dim]) by the per-token angles in cos/sin ([T, 1, head_dim])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
