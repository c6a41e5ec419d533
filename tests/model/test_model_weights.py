"""What LlamaModel holds: every projection and the output head is a LinearWeight (float tensors wrapped in a
FloatWeight at construction), the tied head is the embedding object, and weight_bytes counts each matrix once."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.config import ModelConfig
from leanserve.model.llama import LlamaModel
from leanserve.quantization.weights import FloatWeight, Int8Weight

import pytest
import torch

VOCAB, H, INTER = 96, 64, 128


def _weights(tied: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig(architecture="llama", num_layers=2, hidden_size=H, intermediate_size=INTER, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=tied, attention_bias=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    w = {"model.embed_tokens.weight": rnd(VOCAB, H), "model.norm.weight": 1 + rnd(H)}
    if not tied:
        w["lm_head.weight"] = rnd(VOCAB, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rnd(H), p + "post_attention_layernorm.weight": 1 + rnd(H),
              p + "self_attn.q_proj.weight": rnd(64, H), p + "self_attn.k_proj.weight": rnd(32, H),
              p + "self_attn.v_proj.weight": rnd(32, H), p + "self_attn.o_proj.weight": rnd(H, 64),
              p + "self_attn.q_proj.bias": rnd(64), p + "self_attn.k_proj.bias": rnd(32),
              p + "self_attn.v_proj.bias": rnd(32),
              p + "mlp.gate_proj.weight": rnd(INTER, H), p + "mlp.up_proj.weight": rnd(INTER, H),
              p + "mlp.down_proj.weight": rnd(H, INTER)}
    return cfg, w


@pytest.mark.parametrize(("quantization", "dtype", "tied"), [("none", torch.float32, True),
                                                             ("none", torch.bfloat16, False),
                                                             ("int8", torch.float32, True)])
def test_every_projection_is_a_linear_weight(quantization: str, dtype: torch.dtype, tied: bool) -> None:
    cfg, w = _weights(tied)
    embed = w["model.embed_tokens.weight"].clone()
    model = LlamaModel(cfg, w, dtype=dtype, quantization=quantization, max_position=64, native_kernels=False)
    proj = Int8Weight if quantization == "int8" else FloatWeight
    for layer in model.layers:
        assert all(isinstance(p, proj) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        assert layer.qkv.shape == (128, H) and layer.gate_up.shape == (2 * INTER, H) and layer.down.shape == (H, INTER)
        assert isinstance(layer.qkv_bias, torch.Tensor)
    assert isinstance(model.embed, FloatWeight) and model.embed.dtype == dtype  # the head stays float
    assert (model.lm_head is model.embed) == tied and isinstance(model.lm_head, FloatWeight)
    ids = torch.tensor([3, 0, 95])
    assert torch.equal(model.embed_tokens(ids), embed.to(dtype)[ids])
    hidden = torch.randn(5, H).to(dtype)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    held = [model.embed, model.norm] + ([] if tied else [model.lm_head])
    held += [t for layer in model.layers for t in vars(layer).values() if t is not None]
    size = dtype.itemsize
    expect = sum(t.qweight.numel() + t.scales.numel() * t.scales.element_size() if isinstance(t, Int8Weight)
                 else (t.weight if isinstance(t, FloatWeight) else t).numel() * size for t in held)
    assert model.weight_bytes() == expect
