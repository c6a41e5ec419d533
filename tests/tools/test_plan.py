"""``leanserve plan``: the 7B rule of thumb, KV bytes per token, and the fit arithmetic."""

from __future__ import annotations

import json

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.cli import main
from leanserve.tools.plan import config_from_path, fit_plan, parse_bytes, plan_report, weight_plan

from tests.conftest import repo_root

LLAMA2_7B = str(repo_root() / "examples" / "llama-2-7b-config.json")


def test_llama2_7b_rule_of_thumb() -> None:
    cfg = config_from_path(LLAMA2_7B)
    assert weight_plan(cfg, "fp16").params == 6_738_415_616  # Llama-2-7B's published parameter count
    gb = {p: weight_plan(cfg, p).nominal_bytes / 1e9 for p in ("fp16", "int8", "int4")}
    assert 13.0 <= gb["fp16"] <= 14.5 and 6.5 <= gb["int8"] <= 7.25 and 3.25 <= gb["int4"] <= 3.6
    # int4 group-32 stores a bf16 scale and zero per 32 weights of a matrix: +1 bit per weight (65 norms excluded)
    int4 = weight_plan(cfg, "int4")
    assert int4.total_bytes == int4.nominal_bytes + (6_738_415_616 - 65 * 4096) // 8
    report = plan_report(cfg, None)
    assert report["kv_bytes_per_token"] == {"fp32": 2 * 32 * 32 * 128 * 4, "fp16": 2 * 32 * 32 * 128 * 2,
                                            "int8": 2 * 32 * 32 * (128 + 4)}


def test_fit_arithmetic() -> None:
    cfg = config_from_path(LLAMA2_7B)
    f = fit_plan(cfg, "fp16", "fp16", parse_bytes("24GB"), max_model_len=4096, reserve_bytes=parse_bytes("1GB"))
    weights = weight_plan(cfg, "fp16").total_bytes
    assert f.kv_pool_bytes == 24 * 10**9 - weights - 10**9
    assert f.max_tokens == f.kv_pool_bytes // (2 * 32 * 32 * 128 * 2)
    assert f.fits and f.max_concurrent_seqs == f.max_tokens // 4096 and f.spare_tokens == f.max_tokens - 4096
    tight = fit_plan(cfg, "fp16", "fp16", parse_bytes("14GB"), max_model_len=4096)
    assert not tight.fits and tight.max_concurrent_seqs == 0 and tight.spare_tokens == 0
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("1e9") == 10**9


def test_plan_cli(capsys, tmp_path) -> None:
    assert main(["plan", "--model", LLAMA2_7B, "--memory", "24GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["num_layers"] == 32 and len(report["fit"]) == 12
    assert main(["plan", "--memory", "1GiB"]) == 0  # the default GGUF: metadata only
    out = capsys.readouterr().out
    assert "46,080 B" in out and "12,240 B" in out
    assert main(["plan", "--model", str(tmp_path / "missing.json")]) == 2


def test_sliding_window_layers_hold_only_the_window() -> None:
    """A Gemma-3-like layout (5 of every 6 layers local, window 512): a context token costs the global layers'
    bytes only, after the local layers' own pool (max_num_seqs x (cdiv(512, 16) + 2) + cdiv(2048, 16) blocks at the
    engine's defaults); a pool too small to split is planned as one pool for every layer, as the engine does."""
    import dataclasses

    from leanserve.quantization.kv_cache import kv_bytes_per_token
    from leanserve.tools.plan import context_kv_bytes_per_token, kv_pool_tokens, sliding_layers

    base = config_from_path(LLAMA2_7B)
    layers = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(base.num_layers))
    cfg = dataclasses.replace(base, layer_types=layers, sliding_window=512)
    per_token = kv_bytes_per_token(cfg, "auto", "float16")
    assert sliding_layers(cfg) == 27 and sliding_layers(base) == 0
    assert context_kv_bytes_per_token(cfg, "auto", "float16") == per_token * 5 // 32
    local = (64 * (32 + 2) + 2048 // 16) * 16 * per_token * 27 // 32
    pool = 40 * 10**9
    tokens, local_bytes = kv_pool_tokens(cfg, pool, "auto", "float16")
    assert local_bytes == local
    assert tokens == (pool - local) // (16 * per_token * 5 // 32) * 16
    assert tokens > 3 * pool // per_token  # over 3x the tokens of counting every layer (the local pool: 16 GB)
    f = fit_plan(cfg, "fp16", "fp16", pool + weight_plan(cfg, "fp16").total_bytes, max_model_len=4096)
    assert (f.max_tokens, f.local_kv_bytes, f.context_kv_bytes_per_token) == (tokens, local, per_token * 5 // 32)
    small = 10**9  # under the local pool's bytes: one pool, every layer
    assert kv_pool_tokens(cfg, small, "auto", "float16") == (small // (per_token * 16) * 16, 0)
    assert kv_pool_tokens(base, pool, "auto", "float16") == (pool // per_token, 0)
    report = plan_report(cfg, None)
    assert report["sliding_window"] == {"layers": 27, "window": 512, "context_kv_bytes_per_token": {
        "fp32": per_token * 2 * 5 // 32, "fp16": per_token * 5 // 32, "int8": 2 * 32 * 32 * (128 + 4) * 5 // 32}}
