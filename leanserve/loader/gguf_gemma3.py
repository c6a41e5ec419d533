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
from leanserve.loader.gguf_tensors import check_tensor_types, dequantize_tensor, field, tensor_shape
from leanserve.quantization.kquant import TYPE_SIZE, KQuantWeight
from leanserve.quantization.weights import GroupQuantized

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

LOCAL_ROPE_THETA = 10000.0  # llama.cpp rope_freq_base_train_swa, transformers rope_local_base_freq


def read_q5_0_as_8bit(tensor: gguf.ReaderTensor) -> GroupQuantized:
    """A Q5_0 matrix as an exact 8-bit :class:`GroupQuantized` (the Q8_0 form): codes ``q - 16`` in -16..15, the
    block's fp16 ``d`` as scale, so ``dequantize()`` equals gguf-py's ``d * (q - 16)`` bit for bit.

    Q5_0 block (22 bytes, ggml-common.h): ``d`` fp16, ``qh`` uint32 (bit j: the 5th bit of element j), 16 bytes of
    nibbles (element j < 16: low nibble of byte j, else the high nibble of byte j - 16).

    Raises:
        ModelLoadError: not a Q5_0 matrix, or a data size inconsistent with its shape.
    """
    shape = tensor_shape(tensor)
    if tensor.tensor_type != QT.Q5_0 or len(shape) != 2:
        raise ModelLoadError(f"tensor {tensor.name!r} is not a Q5_0 matrix")
    out, k = shape
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    if k % 32 or raw.size != out * (k // 32) * 22:
        raise ModelLoadError(f"tensor {tensor.name!r}: {raw.size} bytes do not hold {shape} Q5_0")
    blocks = raw.reshape(-1, 22)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(out, k // 32)
    qh = blocks[:, 2:6].copy().view("<u4")  # [blocks, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [blocks, 32]
    qs = blocks[:, 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    codes = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8).reshape(out, k)
    return GroupQuantized(torch.from_numpy(codes), torch.from_numpy(d), None, 0, 8)


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
    is Q8_0 in the Q4_K_M files), Q5_0 ones as their exact 8-bit form (:func:`read_q5_0_as_8bit`) and Q4_K / Q6_K
    ones as :class:`KQuantWeight` (the file's bytes, no extension attached yet). Without ``native`` every tensor is
    dequantized to float32 (gguf-py's arithmetic).

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
        if native and name.endswith(("_proj.weight", "embed_tokens.weight")):
            if tensor.tensor_type in NATIVE_TYPES:
                weights[name] = read_group_quantized(tensor)
                continue
            if tensor.tensor_type == QT.Q5_0:
                weights[name] = read_q5_0_as_8bit(tensor)
                continue
            if int(tensor.tensor_type) in TYPE_SIZE:  # Q4_K / Q6_K: the file's bytes, for the native kernel
                out = tensor_shape(tensor)[0]
                raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
                weights[name] = KQuantWeight(torch.from_numpy(raw.copy()).view(out, -1), int(tensor.tensor_type))
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
