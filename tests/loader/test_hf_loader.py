"""Loading Hugging Face folders written by transformers' own ``save_pretrained``."""

from __future__ import annotations

import json
import os

from leanserve.errors import ModelLoadError
from leanserve.loader import default_model_path, load_model

import pytest
import torch

SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def save_tiny(folder, arch: str, hf_tokenizer, dtype=torch.float32, **overrides):
    """A random tiny model of ``arch`` with the default model's tokenizer, saved with save_pretrained."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    if "rope_scaling" in overrides:  # transformers' config adds rope_theta to the dict it is given
        overrides = {**overrides, "rope_scaling": dict(overrides["rope_scaling"])}
    sharded = overrides.pop("_sharded", False)
    config = config_cls(vocab_size=len(hf_tokenizer), **{**SIZES, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # make norms and biases non-trivial so a mix-up would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param))
    shard = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(folder, **shard)
    hf_tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": False, "rope_theta": 1e6}),
    ("mistral", {"tie_word_embeddings": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
def test_tiny_hf_folder_loads(tmp_path, hf_tokenizer, arch, overrides):
    ref = save_tiny(tmp_path, arch, hf_tokenizer, **overrides)
    model = load_model(str(tmp_path))
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == (arch, 2, 64, 128)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 49152)
    assert (c.max_position_embeddings, c.rms_norm_eps) == (1024, 1e-5)
    assert c.tie_word_embeddings is overrides["tie_word_embeddings"]
    assert c.attention_bias is (arch == "qwen2")
    assert c.rope_theta == overrides.get("rope_theta", 10000.0)
    assert c.rope_scaling == overrides.get("rope_scaling")
    expected = ref.state_dict()
    if c.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(model.weights) == set(expected)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in model.weights
    for name, tensor in model.weights.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, expected[name]), name
    assert model.tokenizer.encode("<|im_start|>hi 你好") == hf_tokenizer.encode("<|im_start|>hi 你好")
    assert model.tokenizer.chat_template == hf_tokenizer.chat_template


def test_sharded_bf16_folder(tmp_path, hf_tokenizer):
    ref = save_tiny(tmp_path, "llama", hf_tokenizer, dtype=torch.bfloat16, tie_word_embeddings=False,
                    _sharded=True)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    model = load_model(str(tmp_path))
    for name, tensor in ref.state_dict().items():
        assert model.weights[name].dtype == torch.float32
        assert torch.equal(model.weights[name], tensor.float()), name


def test_llama3_rope_scaling_is_copied(tmp_path, hf_tokenizer):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    save_tiny(tmp_path, "llama", hf_tokenizer, rope_scaling=scaling, rope_theta=500000.0)
    config = load_model(str(tmp_path)).config
    assert config.rope_scaling == scaling and config.rope_theta == 500000.0


def test_unknown_architecture_and_missing_files(tmp_path, hf_tokenizer):
    save_tiny(tmp_path, "llama", hf_tokenizer)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        load_model(str(tmp_path))
    config_file.write_text(json.dumps({**config, "num_hidden_layers": 3}))  # weights lack layer 2
    with pytest.raises(ModelLoadError, match="missing tensor"):
        load_model(str(tmp_path))
    config_file.unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))
