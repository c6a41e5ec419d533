"""Several models in one server, without loading one: the models config and flags -> ModelSpecs (and their
errors, naming the field), the ServedModels registry, the fair step lock, ``serve``'s refusals before any model
loads, and ``leanserve plan`` sizing a set of models."""

from __future__ import annotations

import json
import threading
import time

from leanserve.cli import main
from leanserve.config import EngineConfig
from leanserve.engine.step_lock import StepLock
from leanserve.entrypoints.openai.models_config import (
    ModelSpec,
    load_models_config,
    model_specs,
    served_names,
)
from leanserve.entrypoints.openai.served_models import ServedModel, ServedModels
from leanserve.entrypoints.openai.serving_common import OpenAIError
from leanserve.errors import InvalidParameterError
from leanserve.loader import default_model_path
from leanserve.tools.plan import config_from_path, set_fit_plan, weight_plan

import pytest

from tests.conftest import repo_root

LLAMA2_7B = str(repo_root() / "examples" / "llama-2-7b-config.json")


def test_repeated_model_flags_pair_with_their_names_and_inherit_the_command_line():
    base = EngineConfig(kv_cache_memory=1 << 26, max_num_seqs=8)
    specs = model_specs(base, ["a.gguf", "b.gguf"], ["one", "two"])
    assert [(s.engine.model, s.served_model_name) for s in specs] == [("a.gguf", "one"), ("b.gguf", "two")]
    assert all(s.engine.kv_cache_memory == 1 << 26 and s.engine.max_num_seqs == 8 for s in specs)
    assert [s.served_model_name for s in model_specs(base, ["a.gguf", "b.gguf"])] == [None, None]
    with pytest.raises(InvalidParameterError, match="given 1 time for 2 model") as e:
        model_specs(base, ["a.gguf", "b.gguf"], ["one"])
    assert e.value.param == "served_model_name"
    with pytest.raises(InvalidParameterError, match="two models are served as 'x'"):
        model_specs(base, ["a.gguf", "b.gguf"], ["x", "x"])


def test_config_entries_override_the_command_line_per_model():
    base = EngineConfig(model="base.gguf", max_num_seqs=8, quantization="auto")
    specs = model_specs(base, None, None, [{"served_model_name": "q"},
                                           {"served_model_name": "f", "quantization": "none", "max_num_seqs": 2,
                                            "speculative_config": {"num_speculative_tokens": 2}}])
    q, f = specs
    assert (q.engine.model, q.engine.quantization, q.engine.max_num_seqs, q.served_model_name) == \
        ("base.gguf", "auto", 8, "q")
    assert (f.engine.model, f.engine.quantization, f.engine.max_num_seqs, f.served_model_name) == \
        ("base.gguf", "none", 2, "f")
    assert f.engine.speculative_config.num_speculative_tokens == 2 and q.engine.speculative_config is None
    # one --model with a config file: the entries' default file
    assert model_specs(base, ["other.gguf"], None, [{}])[0].engine.model == "other.gguf"


@pytest.mark.parametrize(("entries", "param", "text"), [
    ([{}, {"quantisation": "none"}], "models_config[1].quantisation", "unknown field 'quantisation'"),
    ([{"max_num_seqs": 0}], "models_config[0].max_num_seqs", "max_num_seqs must be >= 1"),
    ([{"quantization": "fp8"}], "models_config[0].quantization", "unsupported quantization 'fp8'"),
    ([{"speculative_config": {"method": "eagle"}}], "models_config[0].speculative_config.method", "eagle"),
    ([{"served_model_name": ""}], "models_config[0].served_model_name", "non-empty string"),
    (["smol"], "models_config[0]", "must be a JSON object"),
    ([{"served_model_name": "a"}, {"served_model_name": "a"}], "served_model_name", "two models are served as 'a'"),
    ([{"num_threads": 1}, {"num_threads": 2}], "num_threads", "same num_threads"),
])
def test_a_bad_entry_names_its_field(entries, param, text):
    with pytest.raises(InvalidParameterError, match=text.replace("[", r"\[").replace("(", r"\(")) as e:
        model_specs(EngineConfig(), None, None, entries)
    assert e.value.param == param
    assert param.split(".")[-1] in str(e.value)


def test_models_config_file_and_flags_together(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"served_model_name": "a"}]))
    assert load_models_config(str(path)) == [{"served_model_name": "a"}]
    for text, match in (("{", "not valid JSON"), ("[]", "non-empty JSON list"), ('{"a": 1}', "non-empty JSON list")):
        path.write_text(text)
        with pytest.raises(InvalidParameterError, match=match):
            load_models_config(str(path))
    with pytest.raises(InvalidParameterError, match="cannot read"):
        load_models_config(str(tmp_path / "missing.json"))
    with pytest.raises(InvalidParameterError, match="not both"):
        model_specs(EngineConfig(), ["a", "b"], None, [{}])
    with pytest.raises(InvalidParameterError, match="entry's served_model_name"):
        model_specs(EngineConfig(), None, ["a"], [{}])


def test_default_names_come_from_the_files_and_must_differ():
    default = default_model_path()
    assert served_names([ModelSpec(EngineConfig()), ModelSpec(EngineConfig(), "b")]) == \
        ["SmolLM2-135M-Instruct.Q4_1", "b"]
    with pytest.raises(InvalidParameterError, match="two models are served as 'SmolLM2-135M-Instruct.Q4_1'"):
        served_names([ModelSpec(EngineConfig()), ModelSpec(EngineConfig(model=default))])


@pytest.mark.parametrize(("argv", "text"), [
    (["--model", "a.gguf", "--model", "b.gguf", "--replicas", "2"], "--replicas > 1 (Ray Serve) serves one model"),
    (["--model", "a.gguf", "--model", "b.gguf", "--served-model-name", "x"], "--served-model-name was given 1"),
    ([], "models_config[1].kv_cache_memory: kv_cache_memory must be >= 1"),
    ([], None),
])
def test_serve_refuses_before_any_model_loads(argv, text, tmp_path, capsys):
    if not argv:
        cfg = tmp_path / "models.json"
        if text is None:  # the same file twice without names
            cfg.write_text(json.dumps([{}, {}]))
            text = "two models are served as 'SmolLM2-135M-Instruct.Q4_1'"
        else:
            cfg.write_text(json.dumps([{"served_model_name": "a"}, {"served_model_name": "b", "kv_cache_memory": 0}]))
        argv = ["--models-config", str(cfg)]
    t0 = time.monotonic()
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and text in err and "\n" not in err, err
    assert time.monotonic() - t0 < 5.0  # refused before loading a model


def _served(name: str) -> ServedModel:
    return ServedModel(name, engine=None, chat=None, completion=None, metrics=None)  # type: ignore[arg-type]


def test_served_models_resolve_unknown_default_and_virtual():
    models = ServedModels()
    a, b = _served("a"), _served("b")
    models.add(a)
    models.add(b)
    assert models.resolve("b") is b and models.resolve(None) is a and models.names == ["a", "b"]
    with pytest.raises(OpenAIError) as e:
        models.resolve("c")
    body = e.value.body()["error"]
    assert e.value.status == 404 and body["code"] == "model_not_found" and body["type"] == "invalid_request_error"
    assert body["param"] == "model" and "`c`" in body["message"]
    # a virtual name resolves per request (a router plugs in here)
    models.add_virtual("auto", lambda reg, body: reg.get("b") if body == "long" else reg.get("a"))
    assert models.resolve("auto", "long") is b and models.resolve("auto", "short") is a
    assert models.get("auto") is None and models.names == ["a", "b"]
    with pytest.raises(ValueError):
        models.add(_served("auto"))
    with pytest.raises(ValueError):
        models.add(_served("a"))


def test_step_lock_is_mutual_exclusion_in_arrival_order():
    lock = StepLock()
    order: list[int] = []
    inside = []
    lock.__enter__()  # held: the others queue up in the order they start

    def worker(i: int) -> None:
        with lock:
            inside.append(i)
            assert len(inside) == 1  # alone inside
            order.append(i)
            time.sleep(0.005)
            inside.pop()

    threads = []
    for i in range(5):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while lock.num_waiting < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert lock.num_waiting == 5
    lock.__exit__(None, None, None)
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4] and lock.acquisitions == 6


def test_plan_sizes_a_set_of_models(capsys):
    smol = default_model_path()
    argv = ["plan", "--model", LLAMA2_7B, "--model", smol, "--served-model-name", "llama", "--served-model-name",
            "smol", "--memory", "24GB", "--reserve", "1GB", "--max-model-len", "4096", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["models"]) == ["llama", "smol"]
    llama, small = config_from_path(LLAMA2_7B), config_from_path(smol)
    row = next(f for f in report["set_fit"] if (f["precision"], f["kv_dtype"]) == ("fp16", "fp16"))
    weights = weight_plan(llama, "fp16").total_bytes + weight_plan(small, "fp16").total_bytes
    assert row["weights_bytes"] == weights and row["kv_pool_bytes"] == 24 * 10**9 - weights - 10**9
    seq = {"llama": 4096 * 2 * 32 * 32 * 128 * 2,  # a full sequence's KV bytes: len x 2 x layers x heads x dim x 2
           "smol": 4096 * 2 * small.num_layers * small.num_kv_heads * small.head_dim * 2}
    assert row["max_concurrent_seqs"] == row["kv_pool_bytes"] // (seq["llama"] + seq["smol"]) and row["fits"]
    for name in seq:  # each share holds that many full sequences of its model, and the shares fit in the pool
        assert row["kv_cache_memory"][name] // seq[name] >= row["max_concurrent_seqs"]
    assert sum(row["kv_cache_memory"].values()) <= row["kv_pool_bytes"]
    fp32 = set_fit_plan({"llama": llama, "smol": small}, "fp32", "fp32", 24 * 10**9, 4096)
    assert not fp32.fits and fp32.max_concurrent_seqs == 0  # 27 GB of fp32 weights alone
    assert main(["plan", "--model", smol, "--model", smol]) == 2  # one file twice needs names


class _Engine:
    def __init__(self) -> None:
        self.dead, self.draining, self.num_in_flight, self.calls = None, False, 0, []

    def begin_drain(self) -> None:
        self.draining = True
        self.calls.append("drain")

    def begin_shutdown(self) -> None:
        self.calls.append("shutdown")


def test_the_lifecycle_covers_every_engine():
    """What the gate and LeanserveServer ask of the engine, ServedModels answers for all: a drain drains each, the
    in-flight count sums, and any dead engine is the server's failure (exit 1)."""
    models = ServedModels()
    engines = [_Engine(), _Engine()]
    for name, e in zip("ab", engines, strict=True):
        models.add(ServedModel(name, e, None, None, None))  # type: ignore[arg-type]
    engines[0].num_in_flight, engines[1].num_in_flight = 2, 3
    assert models.num_in_flight == 5 and models.dead is None and not models.draining
    models.begin_drain()
    assert models.draining and [e.calls for e in engines] == [["drain"], ["drain"]]
    engines[1].dead = RuntimeError("boom")
    assert models.dead is engines[1].dead
    models.begin_shutdown()
    assert all(e.calls[-1] == "shutdown" for e in engines)


def test_model_names_serve_and_plan_accept(capsys):
    """``smollm2-135m`` names the default model's file wherever --model is read (serve, plan, the loader)."""
    from leanserve.cli import main
    from leanserve.loader import default_model_path, resolve_model_path

    assert resolve_model_path("smollm2-135m") == resolve_model_path("smollm2") == default_model_path()
    assert resolve_model_path("/no/such/file.gguf") == "/no/such/file.gguf"  # not a name: left to the loader
    assert main(["plan", "--model", "smollm2-135m", "--model", "smollm2", "--served-model-name", "a",
                 "--served-model-name", "b"]) == 0
    assert "a" in capsys.readouterr().out
