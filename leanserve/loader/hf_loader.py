"""Loading a Hugging Face model folder (config.json + safetensors + tokenizer.json)."""

from __future__ import annotations

import json
import os
from typing import Any

from leanserve.config import ModelConfig
from leanserve.errors import ModelLoadError
from leanserve.loader.base import check_weights
from leanserve.tokenizer import Tokenizer

import torch
from safetensors import safe_open

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, HF rope_scaling or None) from transformers 5 ``rope_parameters`` or v4 ``rope_theta`` +
    ``rope_scaling`` (``type`` is renamed ``rope_type``)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def hf_model_config(cfg: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict (Llama, Mistral or Qwen2 causal LM).

    Raises:
        ModelLoadError: unknown architecture, a required key missing, or an unsupported option
            (MLP bias, Llama attention bias).
    """
    names = list(cfg.get("architectures") or [])
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None and not names:
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(cfg.get("model_type"))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {names or cfg.get('model_type')!r} "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError("MLP biases are unsupported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{arch} with attention_bias=True (o_proj bias) is unsupported")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg)
        return ModelConfig(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return [os.path.join(folder, f) for f in files]


def read_hf_weights(folder: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of an HF folder (single or sharded safetensors), cast to contiguous ``torch.float32``.

    ``lm_head.weight`` is dropped when ``config.tie_word_embeddings``.

    Raises:
        ModelLoadError: unreadable shards, or names/shapes that do not match ``config``.
    """
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (
                        config.tie_word_embeddings and name == "lm_head.weight"
                    ):
                        continue
                    weights[name] = f.get_tensor(name).to(torch.float32).contiguous()
        except (OSError, ValueError) as exc:  # safetensors errors subclass these or Exception
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    check_weights(config, weights, folder)
    return weights


def load_hf(folder: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read an HF model folder: (config from ``config.json``, float32 weights, ``tokenizer.json`` tokenizer).

    Raises:
        ModelLoadError: missing/invalid ``config.json``, unknown architecture, bad weights or tokenizer.
    """
    config_file = os.path.join(folder, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {exc}") from exc
    config = hf_model_config(cfg)
    if not config.tie_word_embeddings and "tie_word_embeddings" not in cfg:
        # Some savers drop a tied lm_head and the flag with it: treat a missing lm_head.weight as tied.
        if not _has_tensor(folder, "lm_head.weight"):
            config = hf_model_config({**cfg, "tie_word_embeddings": True})
    tokenizer = Tokenizer.from_dir(folder)
    return config, read_hf_weights(folder, config), tokenizer


def _has_tensor(folder: str, name: str) -> bool:
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return True
    return False
