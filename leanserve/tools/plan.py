"""``leanserve plan``: weight memory at each precision, KV bytes per token at each KV dtype, and what fits.

Arithmetic only (nothing is loaded): parameter counts come from the architecture (:func:`expected_weight_shapes`),
weights take ``params x bits / 8`` bytes (the nominal figure of the "7B model: 14 GB fp16, 7 GB int8, 3.5 GB int4"
rule of thumb), plus the scales leanserve stores beside quantized weights (int8: a bf16 scale per output row; int4:
a bf16 scale and zero per group). KV bytes per token are ``2 x layers x KV heads x head dim x bytes`` (+ an fp32
scale per token and KV head for int8). For a device memory budget the KV pool is what is left after the weights and
a reserve for activations; it holds ``pool // kv_bytes_per_token`` tokens, i.e. that many concurrent tokens, or
``tokens // max_model_len`` sequences of full length.

A model with sliding-window layers (Gemma 3: 15 of 18 layers see the last 512 keys) is planned as the engine
allocates it (:mod:`leanserve.core.sliding_window`, :func:`kv_pool_tokens`): its local layers get their own pool,
bounded by the window and the batch (``max_num_seqs x (cdiv(window, block_size) + 2) + cdiv(max_num_batched_tokens,
block_size)`` blocks, at the engine's defaults unless given), and the rest of the KV memory holds tokens of the
global layers only, so a context token costs ``kv_bytes_per_token x global layers / layers``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

from leanserve.config import EngineConfig, ModelConfig
from leanserve.core.sliding_window import local_pool_size, sliding_window_block_counts
from leanserve.errors import ModelLoadError
from leanserve.loader.base import expected_weight_shapes
from leanserve.quantization.kv_cache import kv_bytes_per_token

# name -> (bits per weight, scale bytes per group, group size in input columns; 0 = per output row)
WEIGHT_PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp32": (32, 0, 0),
    "fp16": (16, 0, 0),
    "int8": (8, 2, 0),
    "int4": (4, 4, 32),
}
KV_DTYPES = {"fp32": ("auto", "float32"), "fp16": ("auto", "float16"), "int8": ("int8", "float32")}
_ENGINE = EngineConfig()  # the engine's defaults: block_size, max_num_seqs, max_num_batched_tokens


def sliding_layers(config: ModelConfig) -> int:
    """How many of the model's layers are sliding-window (local) layers the engine gives their own pool (0 when
    none, or when the config has no window)."""
    if not config.sliding_window:
        return 0
    return sum(config.is_sliding(i) for i in range(config.num_layers))


def kv_pool_tokens(config: ModelConfig, kv_bytes: int, kv_cache_dtype: str = "auto", model_dtype: str = "float32",
                   block_size: int | None = None, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None, max_model_len: int | None = None) -> tuple[int, int]:
    """(context tokens, local-pool bytes) that ``kv_bytes`` of KV cache hold, as the engine splits it
    (:class:`leanserve.engine.LLMEngine`): without sliding-window layers ``kv_bytes // kv_bytes_per_token`` tokens
    and no local pool; with them, the main pool's blocks (global layers only) times ``block_size``, after the local
    pool's bytes (:func:`~leanserve.core.sliding_window.sliding_window_block_counts`). None arguments take the
    engine's defaults (``max_num_batched_tokens``: the default, else ``max_model_len``)."""
    per_token = kv_bytes_per_token(config, kv_cache_dtype, model_dtype)
    swa = sliding_layers(config)
    if not swa:
        return kv_bytes // per_token, 0
    bs = block_size or _ENGINE.block_size
    batched = max_num_batched_tokens or _ENGINE.max_num_batched_tokens or max_model_len or \
        config.max_position_embeddings
    need = local_pool_size(1 << 62, bs, config.sliding_window, max_num_seqs or _ENGINE.max_num_seqs, batched)
    plain = kv_bytes // (per_token * bs)
    main, local = sliding_window_block_counts(plain, kv_bytes, bs, per_token, swa, config.num_layers, need)
    if main == plain and local == plain:  # too small to split: every layer the same pool
        return plain * bs, 0
    return main * bs, local * bs * per_token * swa // config.num_layers


def context_kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "auto", model_dtype: str = "float32") -> int:
    """Bytes one more token of context takes: every layer's (:func:`kv_bytes_per_token`), or only the global
    layers' for a model with sliding-window layers (its local layers' pool is bounded by the window)."""
    per_token = kv_bytes_per_token(config, kv_cache_dtype, model_dtype)
    return per_token * (config.num_layers - sliding_layers(config)) // config.num_layers


@dataclass
class WeightPlan:
    """Weight memory at one precision (bytes)."""

    precision: str
    params: int  # weights counted (all matrices and norms)
    nominal_bytes: int  # params x bits / 8
    total_bytes: int  # nominal + quantization scales (norms kept in fp32 are not split out: they are tiny)


@dataclass
class FitPlan:
    """What fits in ``device_bytes`` for one (weight precision, KV dtype) pair."""

    precision: str
    kv_dtype: str
    kv_bytes_per_token: int  # every layer's
    kv_pool_bytes: int  # device memory - weights - reserve (0 when negative)
    context_kv_bytes_per_token: int  # what one more context token takes (sliding-window models: global layers)
    local_kv_bytes: int  # the sliding-window layers' own pool, bounded by the window (0 without such layers)
    max_tokens: int  # tokens the pool holds, shared by all running sequences
    max_model_len: int
    fits: bool  # the weights fit and at least one max_model_len sequence fits
    max_concurrent_seqs: int  # full-length sequences at once
    spare_tokens: int  # tokens left after one full-length sequence (0 if it does not fit)


def config_from_path(path: str) -> ModelConfig:
    """The architecture of a GGUF file (metadata only), an HF ``config.json`` or a folder holding one.

    Raises:
        ModelLoadError: the path is missing or is none of these.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"no model file or config.json at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from leanserve.loader.gguf_loader import gguf_model_config
        from leanserve.loader.gguf_tensors import open_gguf

        return gguf_model_config(open_gguf(path))
    from leanserve.loader.hf_loader import hf_model_config

    try:
        with open(path, encoding="utf-8") as f:
            return hf_model_config(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is neither a GGUF file nor a JSON config: {exc}") from exc


def weight_plan(config: ModelConfig, precision: str) -> WeightPlan:
    """Weight bytes of ``config`` at ``precision`` (a key of :data:`WEIGHT_PRECISIONS`).

    Raises:
        KeyError: unknown precision.
    """
    bits, scale_bytes, group = WEIGHT_PRECISIONS[precision]
    params = nominal = scales = 0
    for shape in expected_weight_shapes(config).values():
        n = math.prod(shape)
        params += n
        nominal += n * bits // 8
        if len(shape) == 2 and scale_bytes:
            rows, cols = shape
            scales += rows * (cols // group if group else 1) * scale_bytes
    return WeightPlan(precision, params, nominal, nominal + scales)


def fit_plan(config: ModelConfig, precision: str, kv_dtype: str, device_bytes: int, max_model_len: int | None = None,
             reserve_bytes: int = 0) -> FitPlan:
    """How many tokens of KV cache fit beside the weights in ``device_bytes`` (see the module docstring).

    Args:
        precision: weight precision (:data:`WEIGHT_PRECISIONS`). kv_dtype: "fp32", "fp16" or "int8".
        device_bytes: memory of the device (bytes). max_model_len: tokens per sequence (default: the model's).
        reserve_bytes: kept free for activations and the runtime (bytes).
    """
    weights = weight_plan(config, precision).total_bytes
    kv_name, model_dtype = KV_DTYPES[kv_dtype]
    per_token = kv_bytes_per_token(config, kv_name, model_dtype)
    pool = max(0, device_bytes - weights - reserve_bytes)
    length = max_model_len or config.max_position_embeddings
    tokens, local = kv_pool_tokens(config, pool, kv_name, model_dtype, max_model_len=length)
    fits = tokens >= length
    return FitPlan(precision, kv_dtype, per_token, pool, context_kv_bytes_per_token(config, kv_name, model_dtype),
                   local, tokens, length, fits, tokens // length, tokens - length if fits else 0)


def plan_report(config: ModelConfig, device_bytes: int | None, max_model_len: int | None = None,
                reserve_bytes: int = 0) -> dict:
    """Everything ``leanserve plan`` prints, as plain data (JSON-serializable)."""
    report: dict = {
        "config": asdict(config),
        "weights": [asdict(weight_plan(config, p)) for p in WEIGHT_PRECISIONS],
        "kv_bytes_per_token": {k: kv_bytes_per_token(config, *KV_DTYPES[k]) for k in KV_DTYPES},
    }
    if sliding_layers(config):
        report["sliding_window"] = {"layers": sliding_layers(config), "window": config.sliding_window,
                                    "context_kv_bytes_per_token": {k: context_kv_bytes_per_token(config, *KV_DTYPES[k])
                                                                   for k in KV_DTYPES}}
    if device_bytes is not None:
        report["device_bytes"] = device_bytes
        report["fit"] = [asdict(fit_plan(config, p, k, device_bytes, max_model_len, reserve_bytes))
                         for p in WEIGHT_PRECISIONS for k in KV_DTYPES]
    return report


@dataclass
class SetFitPlan:
    """Several models in one server, every one at ``precision`` with ``kv_dtype``, in ``device_bytes``: the KV
    memory left after all their weights (and the reserve) split so each model holds the same number of full-length
    sequences (its share proportional to ``max_model_len x KV bytes per token``)."""

    precision: str
    kv_dtype: str
    weights_bytes: int  # all the models' weights
    kv_pool_bytes: int  # device memory - weights - reserve (0 when negative)
    kv_cache_memory: dict[str, int]  # model -> its share of the pool (bytes): its --kv-cache-memory
    fits: bool  # every model holds at least one full-length sequence
    max_concurrent_seqs: int  # full-length sequences of every model at once


def set_fit_plan(models: dict[str, ModelConfig], precision: str, kv_dtype: str, device_bytes: int,
                 max_model_len: int | None = None, reserve_bytes: int = 0) -> SetFitPlan:
    """The :class:`SetFitPlan` of ``models`` (served name -> architecture) in ``device_bytes``.

    Args:
        precision, kv_dtype: as :func:`fit_plan`, for every model. max_model_len: tokens per sequence of every
            model (default: each model's own context).
    """
    weights = sum(weight_plan(c, precision).total_bytes for c in models.values())
    kv_name, model_dtype = KV_DTYPES[kv_dtype]
    pool = max(0, device_bytes - weights - reserve_bytes)
    # a sliding-window model's local pool is a fixed cost (its size at a pool far larger than it); the rest is split
    local = {n: kv_pool_tokens(c, 1 << 50, kv_name, model_dtype, max_model_len=max_model_len)[1]
             for n, c in models.items()}
    seq_bytes = {n: (max_model_len or c.max_position_embeddings) * context_kv_bytes_per_token(c, kv_name, model_dtype)
                 for n, c in models.items()}
    total = sum(seq_bytes.values())
    rest = max(0, pool - sum(local.values()))
    seqs = rest // total if total else 0
    shares = {n: local[n] + rest * b // total for n, b in seq_bytes.items()} if total else {n: 0 for n in models}
    return SetFitPlan(precision, kv_dtype, weights, pool, shares, seqs >= 1, seqs)


def set_plan_report(models: dict[str, ModelConfig], device_bytes: int | None, max_model_len: int | None = None,
                    reserve_bytes: int = 0) -> dict:
    """``leanserve plan --model A --model B ...``: each model's :func:`plan_report` and, with a device memory,
    the set's fit at each (precision, KV dtype) (:func:`set_fit_plan`)."""
    report: dict = {"models": {n: plan_report(c, device_bytes, max_model_len, reserve_bytes)
                               for n, c in models.items()}}
    if device_bytes is not None:
        report["device_bytes"] = device_bytes
        report["set_fit"] = [asdict(set_fit_plan(models, p, k, device_bytes, max_model_len, reserve_bytes))
                             for p in WEIGHT_PRECISIONS for k in KV_DTYPES]
    return report


def format_set_report(report: dict) -> str:
    """The human-readable tables of :func:`set_plan_report`."""
    gb = 1e9
    parts = []
    for name, r in report["models"].items():
        single = {k: v for k, v in r.items() if k != "fit"}  # the set's table replaces each model's own fit
        parts.append(f"== {name}\n{format_report(single)}")
    if "set_fit" in report:
        names = list(report["models"])
        lines = [f"all {len(names)} models in {report['device_bytes'] / gb:.2f} GB (the KV pool split so that each "
                 "model holds as many full-length sequences):",
                 f"{'weights':<8}{'kv':<6}{'weights GB':>11}{'KV pool GB':>11}{'fits':>6}{'full seqs':>10}  "
                 "--kv-cache-memory per model (GB)"]
        for f in report["set_fit"]:
            shares = ", ".join(f"{n} {f['kv_cache_memory'][n] / gb:.2f}" for n in names)
            lines.append(f"{f['precision']:<8}{f['kv_dtype']:<6}{f['weights_bytes'] / gb:>11.2f}"
                         f"{f['kv_pool_bytes'] / gb:>11.2f}{'yes' if f['fits'] else 'no':>6}"
                         f"{f['max_concurrent_seqs']:>10,}  {shares}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def parse_bytes(text: str) -> int:
    """"24GB" / "24GiB" / "512MB" / "1e9" -> bytes (GB = 1e9, GiB = 2**30).

    Raises:
        ValueError: unparseable text.
    """
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(float(t))


def format_report(report: dict) -> str:
    """The human-readable tables of :func:`plan_report`."""
    cfg = report["config"]
    gb = 1e9
    lines = [f"model: {cfg['architecture']}, {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
             f"{cfg['num_heads']} heads / {cfg['num_kv_heads']} KV heads x {cfg['head_dim']}, "
             f"context {cfg['max_position_embeddings']}", "",
             f"{'weights':<8}{'params':>16}{'nominal GB':>12}{'with scales GB':>16}{'GiB':>8}"]
    for w in report["weights"]:
        lines.append(f"{w['precision']:<8}{w['params']:>16,}{w['nominal_bytes'] / gb:>12.2f}"
                     f"{w['total_bytes'] / gb:>16.2f}{w['total_bytes'] / 2**30:>8.2f}")
    lines += ["", "KV cache bytes per token (2 x layers x KV heads x head dim x bytes):"]
    lines += [f"  {k:<6}{v:>10,} B" for k, v in report["kv_bytes_per_token"].items()]
    if "sliding_window" in report:
        sw = report["sliding_window"]
        lines += [f"{sw['layers']} of {cfg['num_layers']} layers are sliding-window ({sw['window']} keys): they get "
                  "their own pool, bounded by the window and the batch (engine defaults); a context token takes the "
                  "global layers' bytes:"]
        lines += [f"  {k:<6}{v:>10,} B" for k, v in sw["context_kv_bytes_per_token"].items()]
    if "fit" in report:
        lines += ["", f"device memory {report['device_bytes'] / gb:.2f} GB:",
                  f"{'weights':<8}{'kv':<6}{'KV pool GB':>11}{'max tokens':>12}{'max_model_len':>14}{'fits':>6}"
                  f"{'full seqs':>10}{'spare tokens':>13}"]
        for f in report["fit"]:
            lines.append(f"{f['precision']:<8}{f['kv_dtype']:<6}{f['kv_pool_bytes'] / gb:>11.2f}{f['max_tokens']:>12,}"
                         f"{f['max_model_len']:>14,}{'yes' if f['fits'] else 'no':>6}{f['max_concurrent_seqs']:>10,}"
                         f"{f['spare_tokens']:>13,}")
    return "\n".join(lines)
