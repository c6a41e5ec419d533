"""ServerMetrics alone (no model): observations per request and per token gap, registries per app, GPU gauges,
and every name of leanserve.metric_names exported with its kind and help text."""

from __future__ import annotations

from leanserve import metric_names as names
from leanserve.engine.async_engine import AsyncEngineStats
from leanserve.engine.llm_engine import EngineStats
from leanserve.entrypoints.openai.metrics import ServerMetrics, build_1_2_5_buckets, summarize
from leanserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

from prometheus_client.parser import text_string_to_metric_families

STATS = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_blocks=8, num_free_blocks=6,
                    prefix_cache_queries=100, prefix_cache_hits=32, num_preemptions=3, spec_num_drafts=7,
                    spec_num_draft_tokens=20, spec_num_accepted_tokens=11, spec_accepted_per_pos=(6, 3, 2, 0))


def snapshot() -> AsyncEngineStats:
    return AsyncEngineStats(STATS, STATS.num_waiting, STATS.num_running, STATS.kv_cache_usage)


def samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            key = s.name + ("{le=" + s.labels["le"] + "}" if "le" in s.labels else "")
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def output(rid: str, tokens: list[list[int]], times: list[float], finished: bool, reason: str = "length"
           ) -> RequestOutput:
    """A request with one choice per entry of ``tokens``; choice i's last token came at ``times[i]``."""
    choices = []
    for i, (toks, t) in enumerate(zip(tokens, times, strict=True)):
        m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.5, first_token_time=1.0, last_token_time=t,
                           finished_time=t if finished else None, num_generation_tokens=len(toks))
        choices.append(CompletionOutput(index=i, token_ids=list(toks), finish_reason=reason if finished else None,
                                        metrics=m))
    return RequestOutput(rid, None, [1, 2, 3], choices, finished=finished, metrics=choices[0].metrics)


def test_one_observation_per_request_and_one_per_token_gap():
    m = ServerMetrics("m", snapshot, 512)
    m.on_step([output("a", [[5]], [1.0], False)], STATS)
    m.on_step([output("a", [[5, 6]], [1.2], False)], STATS)
    m.on_step([output("a", [[5, 6, 7]], [1.5], True)], STATS)
    s = samples(m)
    assert s["vllm:time_to_first_token_seconds_count"] == 1 and s["vllm:time_to_first_token_seconds_sum"] == 1.0
    assert s["vllm:inter_token_latency_seconds_count"] == 2
    assert abs(s["vllm:inter_token_latency_seconds_sum"] - 0.5) < 1e-9
    assert s["vllm:e2e_request_latency_seconds_sum"] == 1.5 and s["vllm:request_queue_time_seconds_sum"] == 0.5
    assert s["vllm:request_prefill_time_seconds_sum"] == 0.5 and s["vllm:request_decode_time_seconds_sum"] == 0.5
    assert s["vllm:request_time_per_output_token_seconds_sum"] == 0.25
    assert s["vllm:generation_tokens_total"] == 3 and s["vllm:prompt_tokens_total"] == 3
    assert s["vllm:request_success_total{length}"] == 1 and s["vllm:request_success_total{abort}"] == 0
    assert s["vllm:num_requests_running"] == 2 and s["vllm:num_requests_waiting"] == 1
    assert s["vllm:kv_cache_usage_perc"] == 0.25 and s["vllm:num_preemptions_total"] == 3
    assert s["vllm:prefix_cache_queries_total"] == 100 and s["vllm:prefix_cache_hits_total"] == 32
    assert s["process_resident_memory_bytes"] > 0


def test_n_choices_count_once_per_request():
    m = ServerMetrics("m", snapshot, 512)
    # two choices stepping in one engine step: one RequestOutput per stepped choice
    m.on_step([output("a", [[5], []], [1.0, 0.0], False), output("a", [[5], [8]], [1.0, 1.1], False)], STATS)
    m.on_step([output("a", [[5, 6], [8]], [1.3, 1.1], False), output("a", [[5, 6], [8, 9]], [1.3, 1.4], True)],
              STATS)
    s = samples(m)
    assert s["vllm:generation_tokens_total"] == 4 and s["vllm:prompt_tokens_total"] == 3
    assert s["vllm:inter_token_latency_seconds_count"] == 2
    assert s["vllm:time_to_first_token_seconds_count"] == 1 and s["vllm:request_generation_tokens_sum"] == 4
    summary = summarize(output("a", [[5, 6], [8, 9]], [1.3, 1.4], True))
    assert summary.num_generation_tokens == 4 and abs(summary.e2e_latency - 1.4) < 1e-9


def test_registries_are_per_app():
    a, b = ServerMetrics("m", snapshot, 512), ServerMetrics("m", snapshot, 512)
    a.on_step([output("x", [[1]], [1.0], True)], STATS)
    assert samples(a)["vllm:time_to_first_token_seconds_count"] == 1
    assert samples(b)["vllm:time_to_first_token_seconds_count"] == 0


def test_gpu_memory_gauges(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2000)
    s = samples(ServerMetrics("m", snapshot, 512))
    assert s["leanserve:gpu_memory_allocated_bytes"] == 1000 and s["leanserve:gpu_memory_reserved_bytes"] == 2000


def test_token_buckets():
    assert build_1_2_5_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_sample_name_helpers():
    assert names.counter_sample(names.NUM_PREEMPTIONS) == "vllm:num_preemptions_total"
    assert names.histogram_sum(names.REQUEST_QUEUE_TIME_SECONDS) == "vllm:request_queue_time_seconds_sum"
    assert names.histogram_count(names.REQUEST_QUEUE_TIME_SECONDS) == "vllm:request_queue_time_seconds_count"
    assert names.histogram_bucket(names.REQUEST_QUEUE_TIME_SECONDS) == "vllm:request_queue_time_seconds_bucket"


def test_every_name_in_metric_names_is_exported_with_its_kind_and_help(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2000)
    m = ServerMetrics("m", snapshot, 512)
    m.on_step([output("a", [[5, 6]], [1.2], True)], STATS)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    kinds = {**dict.fromkeys(names.GAUGES + names.GPU_GAUGES, "gauge"), **dict.fromkeys(names.COUNTERS, "counter"),
             **dict.fromkeys(names.HISTOGRAMS, "histogram")}
    assert set(kinds) == set(names.HELP)  # every name has its help text, and no help text lacks a name
    for name, kind in kinds.items():
        family = families[name]
        assert family.type == kind and family.documentation == names.HELP[name], name
        expected = {"gauge": {name}, "counter": {names.counter_sample(name)},
                    "histogram": {names.histogram_sum(name), names.histogram_count(name),
                                  names.histogram_bucket(name)}}[kind]
        assert {s.name for s in family.samples} == expected, name
        label = names.DEVICE_LABEL if name in names.GPU_GAUGES else names.MODEL_NAME_LABEL
        assert all(label in s.labels for s in family.samples), name
    assert {s.labels[names.FINISHED_REASON_LABEL] for s in families[names.REQUEST_SUCCESS].samples} == {
        "stop", "length", "abort"}
    per_pos = {s.labels[names.POSITION_LABEL]: s.value
               for s in families[names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS].samples}
    assert per_pos == {"0": 6, "1": 3, "2": 2, "3": 0}
    assert [families[n].samples[0].value for n in (names.SPEC_DECODE_NUM_DRAFTS, names.SPEC_DECODE_NUM_DRAFT_TOKENS,
                                                    names.SPEC_DECODE_NUM_ACCEPTED_TOKENS)] == [7, 20, 11]
