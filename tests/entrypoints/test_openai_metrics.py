"""/metrics: vLLM's names and labels; one observation per request; TTFT counted from the HTTP arrival."""

from __future__ import annotations

import json
import re
import time

import httpx

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]
FILLER = ("amber basil cedar dune ember fjord glade heron iris jade kelp lotus maple nectar onyx pine quartz "
          "raven sage tulip umber violet willow yarrow zinnia").split() * 2
PER_REQUEST = ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
               "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def test_metric_names_and_labels(server):
    r = httpx.get(f"{server.url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    label = f'model_name="{server.model}"'
    for name in GAUGES + COUNTERS:
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(label)}[^}}]*\}} ", text, re.M), name
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text, name
        assert re.search(rf"^{re.escape(name)}_count\{{[^}}]*{re.escape(label)}", text, re.M), name
    for reason in ("stop", "length", "abort"):
        assert re.search(rf'^vllm:request_success_total\{{[^}}]*finished_reason="{reason}"', text, re.M)
    assert re.search(r"^process_resident_memory_bytes [0-9.e+]+$", text, re.M)
    m = server.metrics()
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0


def test_one_observation_per_request_and_ttft_from_arrival(server, client):
    before = server.metrics()
    client_ttfts, completion_tokens = [], 0
    for i in range(5):
        # ~150 new prompt tokens each (no prefix-cache hit past the system prompt): a TTFT long enough that the
        # client's extra delays (HTTP, scheduling of its own thread) stay well under 10% of it
        content = f"Request {i}. " + " ".join(f"{w}{i}" for w in FILLER) + " Name a color."
        body = {"model": server.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first = None
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(ch["delta"].get("content") for ch in chunk["choices"]):
                    first = time.monotonic() - t0
                if chunk.get("usage"):
                    completion_tokens += chunk["usage"]["completion_tokens"]
        assert first is not None
        client_ttfts.append(first)
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for name in PER_REQUEST:
        assert delta(f"{name}_count") == 5, name
    assert delta("vllm:request_success_total") == 5
    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:inter_token_latency_seconds_count") == completion_tokens - 5
    server_sum, client_sum = delta("vllm:time_to_first_token_seconds_sum"), sum(client_ttfts)
    print(f"TTFT sum: server {server_sum:.3f} s, client {client_sum:.3f} s")
    assert abs(server_sum - client_sum) <= 0.1 * client_sum, (server_sum, client_ttfts)
    assert server_sum <= client_sum  # the server's clock starts after the client's and stops before
