"""The command line is derived from the config dataclasses: every field has its flag, values reach the right field,
and a refused value is one line naming the flag, before any model loads."""

from __future__ import annotations

from dataclasses import fields

from leanserve.cli import build_parser, engine_config, main
from leanserve.config import EngineConfig, ServerConfig, config_from_args, flag_of
from leanserve.errors import InvalidParameterError

import pytest


def test_every_config_field_has_a_flag_on_the_commands_that_take_it():
    serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for cls in (EngineConfig, ServerConfig):
        for f in fields(cls):
            assert flag_of(cls, f.name) in serve_help, f.name


def test_request_seed_and_engine_seed_are_separate():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--seed", "5", "--engine-seed", "7"])
    assert args.seed == 5 and engine_config(args).seed == 7
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.seed is None and engine_config(args).seed == 0


def test_flags_reach_their_fields():
    args = build_parser().parse_args(["serve", "--threads", "2", "-q", "int8", "--no-enable-prefix-caching", "--port",
                                      "0", "--speculative-config", '{"num_speculative_tokens": 3}',
                                      "--kv-cache-prefault"])
    cfg, server = engine_config(args), config_from_args(ServerConfig, args)
    assert (cfg.num_threads, cfg.quantization, cfg.enable_prefix_caching) == (2, "int8", False)
    assert cfg.kv_cache_prefault and not engine_config(build_parser().parse_args(["serve"])).kv_cache_prefault
    assert cfg.speculative_config.num_speculative_tokens == 3 and server.port == 0


@pytest.mark.parametrize(("argv", "flag"), [(["serve", "--threads", "0"], "--threads"),
                                            (["serve", "--port", "70000"], "--port"),
                                            (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
                                            (["generate", "--prompt", "x", "--kv-cache-memory", "-5"],
                                             "--kv-cache-memory"),
                                            (["serve", "--speculative-config", '{"method": "eagle"}'],
                                             "--speculative-config"),
                                            (["serve", "--answer-cache-similarity", "0.8"],
                                             "--answer-cache-similarity"),
                                            (["serve", "--answer-cache", "exact", "--answer-cache-similarity", "0.9"],
                                             "--answer-cache-similarity"),
                                            (["serve", "--answer-cache", "semantic", "--answer-cache-similarity",
                                              "1.5"], "--answer-cache-similarity"),
                                            (["serve", "--history-summary-tokens", "-1"], "--history-summary-tokens"),
                                            (["serve", "--answer-cache-ttl", "60"], "--answer-cache-ttl"),
                                            (["serve", "--answer-cache-bytes", "1000000"], "--answer-cache-bytes")])
def test_a_refused_value_is_one_line_naming_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}: ") and "\n" not in err


def test_answer_cache_ttl_and_bytes_only_with_an_answer_cache():
    assert ServerConfig(answer_cache="exact", answer_cache_ttl=60.0, answer_cache_bytes=1000).answer_cache_ttl == 60.0
    for name, value in (("answer_cache_ttl", 60.0), ("answer_cache_bytes", 1000)):
        with pytest.raises(InvalidParameterError, match="applies to the answer cache only") as e:
            ServerConfig(**{name: value})
        assert e.value.param == name


def test_answer_cache_similarity_only_with_the_semantic_cache():
    assert ServerConfig(answer_cache="semantic", answer_cache_similarity=0.8).answer_cache_similarity == 0.8
    assert ServerConfig(answer_cache="semantic").answer_cache_similarity is None  # the cache's default, 0.9
    with pytest.raises(InvalidParameterError, match="semantic answer cache only; answer_cache is 'off'") as e:
        ServerConfig(answer_cache_similarity=0.8)
    assert e.value.param == "answer_cache_similarity"


def test_history_summary_tokens_of_the_whole_context_is_refused_at_startup(capsys):
    """As the request field: a summary budget of the model's whole context cannot run (checked once the model's
    context length is known, before the server serves)."""
    assert main(["serve", "--history-summary-tokens", "100000", "--port", "0", "--max-model-len", "2048"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --history-summary-tokens: history_summary_tokens must be less than the model's context " \
        "length (2048), got 100000"


@pytest.mark.parametrize("variable, value, message", [
    ("LEANSERVE_KERNEL_ISA", "avx512", "$LEANSERVE_KERNEL_ISA must be one of native, avx2, not 'avx512'"),
    ("LEANSERVE_BF16_GEMM", "tiles", "$LEANSERVE_BF16_GEMM must be auto or one of avx512_bf16, amx, not 'tiles'"),
])
def test_a_bad_kernel_environment_variable_is_one_error_line(variable, value, message, monkeypatch, capsys):
    """A typo in a kernel switch fails the command (exit 2, one line), not a silent fall back to slower paths."""
    from leanserve import kernels

    monkeypatch.setenv(variable, value)
    kernels.native_ops.cache_clear()
    try:
        assert main(["generate", "--prompt", "hi", "--max-tokens", "1", "--prefill-gemm", "lane"]) == 2
    finally:
        kernels.native_ops.cache_clear()  # rebuilt (a cached module) with the restored environment
    assert capsys.readouterr().err.strip() == f"error: {message}"
