"""Loading a Gemma 3 GGUF file (``general.architecture = gemma3``): its config and HF-named weights.

What the file does not say is taken from llama.cpp and transformers, which agree on it: the local (sliding-window)
layers' RoPE base is 10000 and every sixth layer is global (``Gemma3TextConfig`` defaults); the attention scale is
``head_dim**-0.5`` (``query_pre_attn_scalar = head_dim``; llama.cpp uses hidden / heads for the 27B model only,
which this loader reads from the sizes). Norm weights are stored by llama.cpp as ``1 + w``; they are returned as
HF's ``w`` (``w = gguf - 1``, as transformers' GGUF loader does), and the model multiplies by ``1 + w``. Q/K rows
are not permuted (Gemma's RoPE is the rotate-half layout in both).
"""

from __future__ import annotations

from typing import Any

from leanserve.config import ModelConfig
from leanserve.errors import ModelLoadError
from leanserve.loader.gemma3_names import (
    GEMMA3,
    gemma3_hf_name,
    gemma3_layer_types,
    gemma3_weight_shapes,
    is_gemma_norm,
)
from leanserve.loader.gguf_quant import NATIVE_TYPES, read_group_quantized
from leanserve.loader.gguf_tensors import check_tensor_types, dequantize_tensor, field
from leanserve.quantization.weights import GroupQuantized

import gguf
import numpy as np
import torch

LOCAL_ROPE_THETA = 10000.0  # llama.cpp rope_freq_base_train_swa, transformers rope_local_base_freq


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.999999747e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def gemma3_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The :class:`ModelConfig` of a Gemma 3 GGUF file: sizes from ``gemma3.*`` metadata, ``vocab_size`` from the
    embedding, tied output, ``layer_types`` from the sixth-layer pattern, ``sliding_window`` from
    ``gemma3.attention.sliding_window``, ``rope_scaling`` (linear, global layers only) from
    ``gemma3.rope.scaling.*``.

    Raises:
        ModelLoadError: not a gemma3 file, a required key missing, an ``output.weight`` (untied) or an unsupported
            RoPE scaling type.
    """
    arch = field(reader, "general.architecture")
    if arch != GEMMA3:
        raise ModelLoadError(f"not a Gemma 3 GGUF file (architecture {arch!r})")

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    if "output.weight" in names:
        raise ModelLoadError("Gemma 3 GGUF with a separate output.weight is unsupported (Gemma ties it)")
    vocab_size, hidden = (int(d) for d in reversed(names["token_embd.weight"].shape.tolist()))
    num_layers = int(need("block_count"))
    num_heads = int(need("attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", 256))
    if int(field(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError("Gemma 3 GGUF with value_length != key_length is unsupported")
    scaling = None
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 1.0):
        if kind != "linear":
            raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} in a Gemma 3 GGUF file")
        scaling = {"rope_type": "linear", "factor": float(factor)}
    # llama.cpp: hidden / heads for the 27B model (62 layers), head_dim otherwise
    scalar = hidden // num_heads if num_layers == 62 else head_dim
    return ModelConfig(
        architecture=GEMMA3,
        num_layers=num_layers,
        hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(field(reader, f"{arch}.rope.freq_base", 1_000_000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=True,
        attention_bias=False,
        layer_types=gemma3_layer_types(num_layers),
        sliding_window=int(need("attention.sliding_window")),
        rope_local_theta=LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(scalar),
    )


def gemma3_weights(reader: gguf.GGUFReader, config: ModelConfig, native: bool = False
                   ) -> dict[str, torch.Tensor | GroupQuantized]:
    """All weights of a Gemma 3 GGUF file by HF name: float32 contiguous tensors (norms as HF's ``w``, see the
    module notes); with ``native``, matrices of type Q4_0 / Q4_1 / Q8_0 as :class:`GroupQuantized` (the embedding
    is Q8_0 in the Q4_K_M files). K-quant and Q5_0 tensors are dequantized to float32 (gguf-py's arithmetic).

    Raises:
        UnsupportedTensorTypeError: a tensor type leanserve cannot dequantize (checked first).
        ModelLoadError: a tensor with no HF counterpart, or names/shapes that do not match ``config``.
    """
    check_tensor_types(reader)
    weights: dict[str, torch.Tensor | GroupQuantized] = {}
    for tensor in reader.tensors:
        name = gemma3_hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} has no counterpart in a Gemma 3 model")
        if native and tensor.tensor_type in NATIVE_TYPES and name.endswith(("_proj.weight", "embed_tokens.weight")):
            weights[name] = read_group_quantized(tensor)
            continue
        array = dequantize_tensor(tensor)
        if is_gemma_norm(name):
            array = array - np.float32(1.0)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    expected = gemma3_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"GGUF file: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"GGUF file: tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    return weights
