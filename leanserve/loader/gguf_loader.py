"""Loading a llama / mistral / qwen2 GGUF file into HF-named, HF-layout float32 weights (gemma3:
:mod:`leanserve.loader.gguf_gemma3`)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from leanserve.config import ModelConfig
from leanserve.errors import ModelLoadError
from leanserve.loader.base import SUPPORTED_ARCHITECTURES, check_weights
from leanserve.loader.gemma3_names import GEMMA3
from leanserve.loader.gguf_gemma3 import gemma3_model_config, gemma3_weights
from leanserve.loader.gguf_quant import NATIVE_TYPES, read_group_quantized
from leanserve.loader.gguf_tensors import check_tensor_types, dequantize_tensor, field, open_gguf
from leanserve.quantization.weights import GroupQuantized
from leanserve.tokenizer import Tokenizer

import gguf
import numpy as np
import torch

# GGUF tensor name -> HF name. Per-block names are matched on the part after ``blk.{i}.``.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 per-frequency RoPE divisors; becomes config.rope_scaling


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name of a GGUF tensor name, or None if it has no HF counterpart.

    E.g. ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(w, n_head)`` on a Llama q/k projection weight [out, in] or bias [out].

    llama.cpp's converter reorders each head's rows from HF's "first half / second half" RoPE pairing to
    interleaved pairs: ``w.reshape(n_head, 2, out // n_head // 2, *rest).swapaxes(1, 2)``. This is its
    inverse (``n_head`` = query heads for q, KV heads for k). Returns a new C-contiguous array.
    """
    out = w.shape[0]
    if out % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a q/k tensor of {out} rows into {n_head} heads")
    return np.ascontiguousarray(
        w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    ).reshape(w.shape)


def _llama3_scaling(factors: np.ndarray, head_dim: int, theta: float, orig_ctx: int) -> dict[str, Any]:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor (a divisor per frequency).

    llama.cpp writes divisor 1 for high frequencies, ``factor`` for low ones and
    ``1 / ((1 - s) / factor + s)`` in between, where ``s = (orig_ctx / wavelen - low) / (high - low)``
    is linear in 1 / wavelen; two in-between points give ``low`` and ``high`` (``orig_ctx`` from
    metadata, else llama.cpp's default 8192).
    """
    factors = factors.astype(np.float64).reshape(-1)
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    factor = float(factors.max())
    low, high = 1.0, 4.0
    mid = np.flatnonzero((factors > 1 + 1e-6) & (factors < factor - 1e-6))
    if factor > 1 and len(mid) >= 2:
        s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)  # s = a * inv_wavelen + b
        a, b = np.polyfit(inv_wavelen[mid], s, 1)
        span = orig_ctx / a
        low, high = float(-b * span), float(-b * span + span)
    low, high = round(low, 4), round(high, 4)
    # Check: recompute the divisors the way llama.cpp does and require a match.
    wavelen = 1 / inv_wavelen
    smooth = (orig_ctx / wavelen - low) / ((high - low) or 1.0)
    expect = np.where(
        wavelen < orig_ctx / high,
        1.0,
        np.where(wavelen > orig_ctx / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if len(expect) != len(factors) or not np.allclose(expect, factors, rtol=1e-3, atol=1e-4):
        raise ModelLoadError("rope_freqs tensor does not follow llama3 RoPE scaling; cannot express it")
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig_ctx,
    }
    return scaling


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*`` metadata or a llama3 ``rope_freqs`` tensor."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    orig = field(reader, f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        return _llama3_scaling(dequantize_tensor(freqs), head_dim, theta, int(orig or 8192))
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} in GGUF metadata")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor if factor is not None else 1.0)}
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for key, hf_key in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("attn_factor", "attention_factor"),
    ):
        value = field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file's metadata (``{arch}.*`` keys) and tensor list describe.

    ``vocab_size`` is the embedding's row count; ``tie_word_embeddings`` is the absence of ``output.weight``;
    ``attention_bias`` is set for qwen2 (llama/mistral with q/k/v biases are rejected).

    Raises:
        ModelLoadError: unsupported architecture, a required key missing, or partial-rotary RoPE.
    """
    arch = field(reader, "general.architecture")
    if arch == GEMMA3:
        return gemma3_model_config(reader)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    vocab_size, hidden = (int(d) for d in reversed(names["token_embd.weight"].shape.tolist()))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = field(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"partial rotary embedding (rope dim {rope_dim} != head dim {head_dim}) is unsupported"
        )
    has_bias = "blk.0.attn_q.bias" in names
    if has_bias and arch != "qwen2":
        raise ModelLoadError(f"{arch} GGUF with attention biases is unsupported (only qwen2 has them)")
    theta = _f32(field(reader, f"{arch}.rope.freq_base", 10000.0))
    return ModelConfig(
        architecture=arch,
        num_layers=int(need("block_count")),
        hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
    )


def _unpermute_native(g: GroupQuantized, n_head: int) -> GroupQuantized:
    """:func:`unpermute_qk` on a natively quantized q/k matrix: whole rows move, with their scales and biases,
    so the result dequantizes to the un-permuted float matrix exactly."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.from_numpy(unpermute_qk(t.numpy(), n_head))

    return replace(g, codes=rows(g.codes), scale=rows(g.scale), bias=rows(g.bias))


_NATIVE_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def gguf_weights(reader: gguf.GGUFReader, config: ModelConfig,
                 native: bool = False) -> dict[str, torch.Tensor | GroupQuantized]:
    """All weights of a GGUF model, dequantized, renamed to HF and re-laid-out (q/k un-permuted for llama
    and mistral; qwen2 is converted without the permutation). Values: float32 contiguous ``torch.Tensor``;
    with ``native``, the matrices (projections, embedding, output) of type Q4_0 / Q4_1 / Q8_0 are
    :class:`GroupQuantized` instead (no arithmetic on their values).

    Raises:
        UnsupportedTensorTypeError: a tensor type is not supported (checked first).
        ModelLoadError: a tensor has no HF counterpart, or names/shapes do not match ``config``.
    """
    check_tensor_types(reader)
    if config.architecture == GEMMA3:
        return gemma3_weights(reader, config, native=native)
    permuted = config.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has no counterpart in a {config.architecture} model"
            )
        if native and tensor.tensor_type in NATIVE_TYPES and name.endswith(_NATIVE_SUFFIXES):
            g = read_group_quantized(tensor)
            if permuted and ".q_proj." in name:
                g = _unpermute_native(g, config.num_heads)
            elif permuted and ".k_proj." in name:
                g = _unpermute_native(g, config.num_kv_heads)
            weights[name] = g
            continue
        array = dequantize_tensor(tensor)
        if permuted and ".q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif permuted and ".k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(array)
    check_weights(config, weights, "GGUF file")
    return weights


def load_gguf(path: str, native: bool = False
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupQuantized], Tokenizer]:
    """Read a GGUF file: (config, HF weights as in :func:`gguf_weights` with ``native``, tokenizer from its
    metadata).

    Raises:
        ModelLoadError: unreadable file, unsupported architecture/tokenizer, or inconsistent tensors.
        UnsupportedTensorTypeError: a tensor type that cannot be dequantized.
    """
    reader = open_gguf(path)
    check_tensor_types(reader)
    config = gguf_model_config(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    weights = gguf_weights(reader, config, native=native)
    return config, weights, tokenizer
