"""Replica routing on a multi-tenant workload: 2 replicas x 1 thread on Ray Serve (``cache_aware`` and
``round_robin``) against one 2-thread server, with the same total KV memory.

Workload: ``--tenants`` tenants (default 8), each with its own ~``--system-tokens``-token system prompt (default
1,000; distinct standard-library docstring prose per tenant), ``--per-tenant`` requests each, a short question
after the system prompt, interleaved (tenants shuffled in every round), ``--max-tokens`` output tokens (ignore_eos),
Poisson arrivals at ``--rate`` requests/s. Every configuration gets the same requests in the same order.

Each replica has ``--kv-cache-memory`` bytes of KV cache (default 224 MiB, about 5,000 tokens: room for about
half the tenants' prompts), the single server twice that. Reported per configuration, from ``leanserve bench``'s
runner: prefix-cache hit rate (vllm:prefix_cache_hits / queries summed over the replicas), TTFT p50/p99, request
and output throughput, goodput (TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``), and the router's own
time per request (leanserve:router_decision_seconds / requests routed) and the HTTP path's median cost outside
the engine (:func:`hop_overhead_ms`). Then the two targets: cache_aware's hit
rate >= 1.5x round_robin's and its median TTFT <= 0.7x.

Usage (one command; the machine's load changes the numbers, run it on an idle machine when you can):
    PYTHONPATH=$PWD nice -n 19 .venv/bin/python -m benchmarks.replica_routing [--out replica_routing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

from leanserve.bench.command import load_tokenizer
from leanserve.bench.corpus import Corpus
from leanserve.bench.runner import BenchConfig, run_benchmark
from leanserve.bench.server_metrics import parse_samples
from leanserve.bench.workloads import BenchRequest
from leanserve.tools.banner import wait_for_banner_url

import httpx

QUESTIONS = ["What are your opening hours?", "How do I reset my password?", "Can I get a refund?",
             "Where is my order?", "Do you ship abroad?", "How do I change my plan?", "Is there a discount?",
             "Who do I contact for support?"]


def make_requests(corpus: Corpus, tenants: int, per_tenant: int, system_tokens: int, max_tokens: int,
                  seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    passages = [p.text for p in corpus.passages if len(p.text) > 400]
    systems = []
    for t in range(tenants):
        text, k = f"You are the assistant of tenant {t}. Use this manual:\n", t * 37
        while corpus.count(text) < system_tokens:
            text += passages[k % len(passages)] + "\n"
            k += 1
        systems.append(corpus.head(text, system_tokens))
    out = []
    for r in range(per_tenant):
        order = list(range(tenants))
        rng.shuffle(order)
        for t in order:
            q = QUESTIONS[(r + t) % len(QUESTIONS)] + f" (ticket {r}-{t})"
            messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": q}]
            prompt = systems[t] + "\n\n" + q
            out.append(BenchRequest(messages, prompt, corpus.count(prompt), max_tokens))
    return out


class Server:
    """``leanserve serve`` in a subprocess, ready once its banner names the URL."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "leanserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        t0 = time.monotonic()
        self.url = wait_for_banner_url(self.proc, 300)
        if not self.url:
            self.stop()
            raise RuntimeError("server did not start")
        while True:  # the fleet: until every replica's first probe passed
            r = httpx.get(f"{self.url}/health", timeout=30)
            if r.status_code == 200 and (not r.content or r.json().get("status") == "ok"):
                break
            time.sleep(0.5)
        self.start_s = time.monotonic() - t0

    def metrics(self) -> dict[str, float]:
        return parse_samples(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def hop_overhead_ms(url: str, n: int = 20) -> float:
    """Median over ``n`` sequential 1-token completions of (client-side latency - the server's own e2e_ms): the
    HTTP path's cost outside the engine (for the fleet: Ray's proxy, the ingress, the handle call and back)."""
    gaps = []
    with httpx.Client(base_url=url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"model": model, "prompt": f"Hi {i}", "max_tokens": 1}).json()
            gaps.append((time.perf_counter() - t0) * 1000 - r["timings"]["e2e_ms"])
    return sorted(gaps)[n // 2]


def run_one(label: str, args: list[str], requests: list[BenchRequest], a: argparse.Namespace) -> dict:
    srv = Server(args)
    try:
        before = srv.metrics()
        cfg = BenchConfig(base_url=srv.url, endpoint="chat", request_rate=a.rate, seed=a.seed,
                          slos={"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms}, progress=False)
        res = run_benchmark(cfg, requests, label)
        after = srv.metrics()
        hop_ms = hop_overhead_ms(srv.url)
    finally:
        srv.stop()
    m, lat = res.metrics, res.metrics.latency
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    routed = after.get("leanserve:router_requests_total")
    route_s = after.get("leanserve:router_decision_seconds_total")
    row = {"label": label, "start_s": round(srv.start_s, 1), "completed": m.completed, "failed": m.failed,
           "hit_rate": hits / queries if queries else None, "ttft_p50_ms": lat.get("median_ttft_ms"),
           "ttft_p99_ms": lat.get("p99_ttft_ms"), "request_throughput": m.request_throughput,
           "output_throughput": m.output_throughput, "request_goodput": m.request_goodput,
           "router_us_per_request": 1e6 * route_s / routed if routed else None, "hop_overhead_ms": hop_ms}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--per-tenant", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--kv-cache-memory", type=int, default=224 << 20, help="bytes per replica (single: twice)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default="cache_aware,round_robin,single")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    a = p.parse_args(argv)
    corpus = Corpus.load(load_tokenizer(None))
    requests = make_requests(corpus, a.tenants, a.per_tenant, a.system_tokens, a.max_tokens, a.seed)
    common = ["--max-model-len", str(a.max_model_len)]
    rows = []
    for config in a.configs.split(","):
        if config == "single":
            args = [*common, "--threads", "2", "--kv-cache-memory", str(2 * a.kv_cache_memory)]
        else:
            args = [*common, "--replicas", "2", "--threads", "1", "--replica-router", config,
                    "--kv-cache-memory", str(a.kv_cache_memory)]
        rows.append(run_one(config, args, requests, a))
    print(f"\n{len(requests)} requests, {a.tenants} tenants x ~{a.system_tokens}-token system prompts, "
          f"{a.rate:g} req/s, {a.max_tokens} output tokens; KV {a.kv_cache_memory >> 20} MiB per replica")
    print("| config | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | req/s | output tok/s | goodput "
          "(req/s) | router us/req | HTTP path ms |\n|---|---|---|---|---|---|---|---|---|")

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for r in rows:
        print(f"| {r['label']} | {f(r['hit_rate'], '.1%')} | {f(r['ttft_p50_ms'], '.0f')} | "
              f"{f(r['ttft_p99_ms'], '.0f')} | {f(r['request_throughput'], '.2f')} | "
              f"{f(r['output_throughput'], '.1f')} | {f(r['request_goodput'], '.2f')} | "
              f"{f(r['router_us_per_request'], '.0f')} | {f(r['hop_overhead_ms'], '.1f')} |")
    by = {r["label"]: r for r in rows}
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"], by["round_robin"]
        if ca["hit_rate"] is not None and rr["hit_rate"]:
            print(f"hit rate cache_aware / round_robin: {ca['hit_rate'] / rr['hit_rate']:.2f}x (target >= 1.5x)")
        if ca["ttft_p50_ms"] and rr["ttft_p50_ms"]:
            print(f"median TTFT cache_aware / round_robin: {ca['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x "
                  "(target <= 0.7x)")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
