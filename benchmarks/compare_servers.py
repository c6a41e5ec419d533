"""Serving side by side: leanserve vs llama.cpp's llama-server on the same GGUF file, workloads and request rates.

Both servers get the same threads (--threads, default 2) and comparable parallelism: llama-server
``-np SLOTS -c SLOTS*CTX`` (continuous batching is on by default), leanserve ``--max-num-seqs SLOTS
--max-model-len CTX``. Each server runs, for every workload, one ``leanserve bench`` run per rate (the built-in
scenarios of leanserve.bench, chat endpoint, greedy, exact output lengths), then the other server does the same.

Prints every run, a ratio table (leanserve / llama-server), each server's max sustained rate per workload (the
highest swept rate at which >= 90% of requests meet the SLOs, TTFT <= 2 s and TPOT <= 200 ms by default, at it and
every lower rate: DistServe's goodput) and the two target figures leanserve is held to:
  - customer-service: leanserve's max sustained rate / llama-server's (target >= 2x); also, at the highest swept
    rate where llama-server's p99 TTFT stays under 2 s, both servers' request goodput (there llama-server serves
    nearly every request within the SLOs, so no server can reach 2x its goodput in requests/s at that rate);
  - knowledge-qa: leanserve's median TTFT / llama-server's at each rate (target <= 0.5x).
Writes JSON (--out) and one PNG with both servers' curves (--plot).

Usage:
    .venv/bin/python -m benchmarks.compare_servers [--llama-server PATH] [--workloads customer-service,knowledge-qa]
        [--rates 0.5,1,2 | --rates customer-service=0.5,1,2 knowledge-qa=0.05,0.1] [--num-prompts 32]
        [--slo-attainment-goal 0.9]
    llama-server: --llama-server, $LLAMA_SERVER, or where benchmarks/README.md builds it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from leanserve.bench.command import load_tokenizer
from leanserve.bench.corpus import Corpus
from leanserve.bench.plot import plot_sweep
from leanserve.bench.report import print_run, print_sweep
from leanserve.bench.runner import BenchConfig, parse_rates, run_sweep
from leanserve.bench.stats import max_sustained_rate, parse_goodput
from leanserve.bench.workloads import WORKLOADS, make_workload
from leanserve.loader import default_model_path

from benchmarks.common import LeanserveServer, LlamaServer, find_llama_server, write_json

DEFAULT_RATES = {"customer-service": [0.5, 0.75, 1.0, 1.5, 2.0, 3.0], "knowledge-qa": [0.05, 0.1, 0.2],
                 "code-assistant": [0.05, 0.1, 0.2], "copywriting": [0.05, 0.1, 0.2]}
SERVERS = ("leanserve", "llama.cpp")
SERVER_NAMES = {"leanserve": "leanserve", "llama.cpp": "llama-server"}
TTFT_LIMIT_MS = 2000.0
CHAT_TEMPLATE_MARGIN = 64  # tokens a chat template adds around a prompt (room to spare for the default model's)


def rates_by_workload(items: Sequence[str] | None, workloads: Sequence[str]) -> dict[str, list[float]]:
    """``["0.5,1"]`` (all workloads) or ``["customer-service=0.5,1", ...]`` -> rates per workload (defaults else)."""
    out = {w: list(DEFAULT_RATES[w]) for w in workloads}
    for item in items or []:
        name, sep, rates = item.rpartition("=")
        for w in ([name] if sep else workloads):
            if w not in out:
                raise SystemExit(f"error: --rates: unknown workload {w!r}")
            out[w] = parse_rates(rates)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def sustained_rates(results: dict[str, dict[str, list[dict[str, Any]]]], goal: float) -> dict[str, Any]:
    """Per workload: each server's max sustained rate (the highest swept rate whose SLO attainment, and that of
    every lower rate, is >= ``goal``; DistServe's goodput), their ratio, and which figures are only lower bounds
    (the server met the goal at the highest swept rate)."""
    out: dict[str, Any] = {}
    for workload, by_server in results.items():
        best = {name: max_sustained_rate([(_rate_value(r["request_rate"]), r["slo_attainment"]) for r in runs], goal)
                for name, runs in by_server.items()}
        top = max(_rate_value(r["request_rate"]) for r in by_server["leanserve"])
        out[workload] = {"goal": goal, "leanserve": best["leanserve"], "llama.cpp": best["llama.cpp"],
                         "ratio": ratio(best["leanserve"], best["llama.cpp"]),
                         "lower_bounds": [name for name in SERVERS if best[name] == top]}
    return out


def targets(results: dict[str, dict[str, list[dict[str, Any]]]], goal: float) -> dict[str, Any]:
    """The issue's two target figures from ``results[workload][server]`` run dicts (see the module doc)."""
    out: dict[str, Any] = {}
    cs = results.get("customer-service")
    if cs:
        under = [(ls, lc) for ls, lc in zip(cs["leanserve"], cs["llama.cpp"], strict=True)
                 if lc["completed"] and lc["failed"] == 0 and lc["p99_ttft_ms"] < TTFT_LIMIT_MS]
        if under:
            lean, llama = max(under, key=lambda pair: _rate_value(pair[1]["request_rate"]))
            g = ratio(lean["request_goodput"], llama["request_goodput"])
            literal = {"rate": llama["request_rate"], "llama_p99_ttft_ms": llama["p99_ttft_ms"],
                       "leanserve_goodput": lean["request_goodput"], "llama_goodput": llama["request_goodput"],
                       "goodput_ratio": g}
        else:
            literal = {"rate": None, "note": "llama-server's p99 TTFT is >= 2 s at every swept rate"}
        sustained = sustained_rates({"customer-service": cs}, goal)["customer-service"]
        out["customer_service"] = {
            "at_llama_p99_ttft_limit": literal, "max_sustained_rate": sustained, "target": ">= 2x",
            "met": sustained["ratio"] is not None and sustained["ratio"] >= 2.0}
    kq = results.get("knowledge-qa")
    if kq:
        per_rate = [{"rate": lc["request_rate"], "leanserve_median_ttft_ms": ls["median_ttft_ms"],
                     "llama_median_ttft_ms": lc["median_ttft_ms"],
                     "ratio": ratio(ls["median_ttft_ms"], lc["median_ttft_ms"])}
                    for ls, lc in zip(kq["leanserve"], kq["llama.cpp"], strict=True)]
        out["knowledge_qa"] = {"per_rate": per_rate, "target": "<= 0.5x",
                               "met_at_every_rate": all(p["ratio"] is not None and p["ratio"] <= 0.5
                                                        for p in per_rate)}
    return out


def _rate_value(rate: float | str) -> float:
    return math.inf if rate == "inf" else float(rate)


def _fmt(value: float | None, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"


def print_ratios(results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """One line per workload and rate: leanserve / llama-server for throughput, goodput and latencies."""
    keys = ("output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")
    print(f"\n{'workload':<18}{'rate':>7}" + "".join(f"{k:>20}" for k in keys) + "   (leanserve / llama-server)")
    for workload, by_server in results.items():
        for lean, llama in zip(by_server["leanserve"], by_server["llama.cpp"], strict=True):
            cells = [_fmt(ratio(lean[k], llama[k]), "x") for k in keys]
            print(f"{workload:<18}{lean['request_rate']!s:>7}" + "".join(f"{c:>20}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--model", default=None, help="GGUF file served by both (default: the default model)")
    ap.add_argument("--workloads", default="customer-service,knowledge-qa",
                    help=f"comma-separated, from {', '.join(WORKLOADS)} (default: customer-service,knowledge-qa)")
    ap.add_argument("--rates", nargs="+", default=None, help="RATES for all, or WORKLOAD=RATES (requests/s)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default 2)")
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np; leanserve --max-num-seqs")
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens per sequence / slot")
    ap.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="NAME:MS",
                    help="SLOs in milliseconds (default: ttft:2000 tpot:200)")
    ap.add_argument("--slo-attainment-goal", type=float, default=0.9,
                    help="share of requests that must meet every SLO at a sustained rate (default 0.9)")
    ap.add_argument("--seed", type=int, default=0, help="workload and arrival seed of the first rate (default 0)")
    ap.add_argument("--out", default="benchmarks/results/compare_servers.json", help="JSON file to write")
    ap.add_argument("--plot", default="benchmarks/results/compare_servers.png", help="PNG file to write")
    args = ap.parse_args()

    # every argument is checked before a server starts: a sweep can take half an hour
    if not 0 < args.slo_attainment_goal <= 1:
        raise SystemExit(f"error: --slo-attainment-goal must be in (0, 1], got {args.slo_attainment_goal}")
    for name in ("num_prompts", "threads", "slots", "ctx"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    binary = find_llama_server(args.llama_server)
    if binary is None:
        where = f" at {args.llama_server}" if args.llama_server else ""
        raise SystemExit(f"error: llama-server not found{where}: pass --llama-server PATH or build it as "
                         "benchmarks/README.md says")
    model = args.model or default_model_path()
    if not os.path.isfile(model):
        raise SystemExit(f"error: model file not found: {model}")
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"error: unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    try:
        rates = rates_by_workload(args.rates, workloads)
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    tokenizer = load_tokenizer(model)
    corpus = Corpus.load(tokenizer)
    # every run's requests, built once: both servers get the same ones (run i of a sweep uses seed + i)
    requests = {w: {args.seed + i: make_workload(w, corpus, args.num_prompts, args.seed + i)
                    for i in range(len(rates[w]))} for w in workloads}
    for w in workloads:  # the context must hold every request (prompt + chat template + output)
        longest = max(r.prompt_len + r.max_tokens for reqs in requests[w].values() for r in reqs)
        if longest + CHAT_TEMPLATE_MARGIN > args.ctx:
            raise SystemExit(f"error: --ctx {args.ctx} is too short for {w}: a request needs up to "
                             f"{longest + CHAT_TEMPLATE_MARGIN} tokens")

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    servers = {
        "leanserve": lambda: LeanserveServer(model, args.threads, ["--max-num-seqs", str(args.slots),
                                                                   "--max-model-len", str(args.ctx)]),
        "llama.cpp": lambda: LlamaServer(binary, model, args.slots, args.ctx, args.threads, ["--metrics"]),
    }
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    for name in SERVERS:
        with servers[name]() as srv:
            for w in workloads:
                config = BenchConfig(base_url=srv.url, seed=args.seed, slos=slos, progress=True)
                runs = run_sweep(config, requests[w].__getitem__,
                                 rates[w], f"{name} {w}", count_tokens, on_run=print_run)
                print_sweep(runs, goal=args.slo_attainment_goal)
                results[w][name] = [r.to_dict() for r in runs]
    print_ratios(results)
    print(f"\nmax sustained rate (req/s; SLO attainment >= {args.slo_attainment_goal:.0%} at it and below):")
    for workload, row in sustained_rates(results, args.slo_attainment_goal).items():
        bound = (f" (lower bound for {' and '.join(SERVER_NAMES[n] for n in row['lower_bounds'])}: met at the "
                 "highest swept rate)") if row["lower_bounds"] else ""
        print(f"  {workload:<18} leanserve {row['leanserve']}  llama-server {row['llama.cpp']}  "
              f"ratio {_fmt(row['ratio'], 'x')}{bound}")
    figures = targets(results, args.slo_attainment_goal)
    if figures:
        print("\ntargets:\n" + json.dumps(figures, indent=2))
    write_json(args.out, {"model": model, "threads": args.threads, "slots": args.slots, "ctx": args.ctx,
                          "num_prompts": args.num_prompts, "goodput_slos_ms": slos,
                          "slo_attainment_goal": args.slo_attainment_goal, "targets": figures,
                          "results": results})
    print(f"wrote {plot_sweep(results, args.plot, goal=args.slo_attainment_goal)}")


if __name__ == "__main__":
    main()
