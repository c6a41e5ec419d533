"""What every loader returns, and the weight-name/shape contract both loaders check against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leanserve.config import ModelConfig
from leanserve.errors import ModelLoadError
from leanserve.loader.gemma3_names import GEMMA3, gemma3_weight_shapes
from leanserve.tokenizer import Tokenizer

import torch

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")


@dataclass
class LoadedModel:
    """A model ready for the engine: architecture, weights and tokenizer.

    Attributes:
        config: the architecture, read from GGUF metadata or ``config.json``.
        weights: Hugging Face Llama names (see :func:`expected_weight_shapes`) -> HF-layout tensors,
            ``torch.float32``, contiguous, CPU. Linear weights are ``[out_features, in_features]``.
            ``lm_head.weight`` is absent when ``config.tie_word_embeddings``. Natively quantized GGUF projection
            matrices are :class:`leanserve.quantization.weights.GroupQuantized` (``load_model(quantization=)``).
        tokenizer: the model's tokenizer.
        path: the GGUF file or HF folder it was loaded from.
        load_time_s: wall-clock seconds spent in :func:`leanserve.loader.load_model`.
    """

    config: ModelConfig
    weights: dict[str, Any]  # torch.Tensor or GroupQuantized
    tokenizer: Tokenizer
    path: str
    load_time_s: float


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of ``config`` must have, by HF name, with its shape (element counts).

    Per layer ``i``: ``model.layers.{i}.input_layernorm.weight`` [hidden],
    ``self_attn.q_proj.weight`` [heads*head_dim, hidden], ``k_proj``/``v_proj`` [kv_heads*head_dim, hidden],
    ``o_proj`` [hidden, heads*head_dim], q/k/v biases when ``attention_bias``,
    ``post_attention_layernorm.weight`` [hidden], ``mlp.gate_proj``/``up_proj`` [intermediate, hidden],
    ``mlp.down_proj`` [hidden, intermediate]; plus ``model.embed_tokens.weight`` [vocab, hidden],
    ``model.norm.weight`` [hidden] and, unless tied, ``lm_head.weight`` [vocab, hidden]. Gemma 3: see
    :func:`leanserve.loader.gemma3_names.gemma3_weight_shapes`.
    """
    if config.architecture == GEMMA3:
        return gemma3_weight_shapes(config)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Check that ``weights`` has exactly the names and shapes :func:`expected_weight_shapes` lists.

    Raises:
        ModelLoadError: naming the first missing, unexpected or wrongly shaped tensor (``source`` is the
            file or folder, for the message).
    """
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ModelLoadError(f"{source}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    extra = [name for name in weights if name not in expected]
    if extra:
        raise ModelLoadError(f"{source}: unexpected tensor(s) {extra[:5]} ({len(extra)} in all)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
