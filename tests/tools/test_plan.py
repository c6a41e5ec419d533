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
