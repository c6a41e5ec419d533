"""Gemma 3's weight names and shapes (transformers' ``Gemma3ForCausalLM`` names), and GGUF -> HF renaming.

Plain tables and arithmetic: no file is read here (:mod:`leanserve.loader.gguf_gemma3` reads GGUF files,
:mod:`leanserve.loader.base` uses the shapes to check what a loader returns).
"""

from __future__ import annotations

import re

from leanserve.config import ModelConfig

GEMMA3 = "gemma3"

# GGUF name -> HF name (llama.cpp's convert_hf_to_gguf.py Gemma3Model names, transformers' Gemma3 names).
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def gemma3_hf_name(gguf_name: str) -> str | None:
    """The HF name of a Gemma 3 GGUF tensor (``blk.0.ffn_norm.weight`` ->
    ``model.layers.0.pre_feedforward_layernorm.weight``), or None when it has none."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    return None


def is_gemma_norm(hf_name: str) -> bool:
    """Whether an HF Gemma 3 weight is an RMSNorm scale (GGUF stores ``1 + w`` for these, HF stores ``w``)."""
    return hf_name.endswith(("layernorm.weight", "norm.weight"))


def gemma3_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a Gemma 3 model by HF name with its shape (element counts): the embedding
    [vocab, hidden] (tied output, no ``lm_head``), the final norm [hidden], and per layer the four norms [hidden],
    q/k norms [head_dim], q/k/v/o projections and the gated MLP, linear weights as [out, in]."""
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[f"{p}{norm}.weight"] = (h,)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    return shapes


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's interleaving: every ``pattern``-th layer (1-based) global, the others sliding-window (transformers'
    ``Gemma3TextConfig`` default ``sliding_window_pattern=6``, llama.cpp's ``set_swa_pattern(6)``)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
