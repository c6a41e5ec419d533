"""``leanserve bench``: load an OpenAI-compatible server with a built-in scenario or a dataset file, print the
report, and optionally write JSON and a PNG plot; ``--sweep`` runs several request rates."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from leanserve.bench.corpus import Corpus
from leanserve.bench.datasets import load_dataset
from leanserve.bench.report import print_run, print_sweep, sweep_rows, sweep_sustained_rate, write_json
from leanserve.bench.runner import BenchConfig, RunResult, parse_rates, run_benchmark, run_sweep
from leanserve.bench.stats import parse_goodput
from leanserve.bench.workloads import WORKLOADS, BenchRequest, make_workload
from leanserve.tokenizer import Tokenizer


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The options of ``leanserve bench`` (names follow vLLM's ``bench serve``)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root; a trailing /v1 is dropped (default: http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions or /v1/completions")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                     help="built-in scenario (default: customer-service)")
    src.add_argument("--dataset", default=None,
                     help="ShareGPT JSON/JSONL conversations, or JSONL of {\"prompt\", \"max_tokens\"}")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (per rate with --sweep)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="mean requests per second (Poisson / gamma arrivals); default inf: all at once")
    load.add_argument("--sweep", default=None, metavar="RATES",
                      help="comma-separated request rates (e.g. 0.5,1,2,inf): one run each (printed and saved as "
                           "it ends), a summary and a plot")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:10000 (milliseconds)")
    p.add_argument("--slo-attainment-goal", type=float, default=0.9, metavar="FRACTION",
                   help="with --sweep and --goodput: report the highest rate at which at least this share of "
                        "requests meets every SLO (DistServe's goodput; default 0.9)")
    p.add_argument("--result-json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG plot to this file")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder of the served model's tokenizer, for prompt lengths and token counts "
                        "without usage (default: the default model's)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    p.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between polls of the server's /metrics during the run (for peak KV usage)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--compare", default=None, choices=["documents", "answer-cache"],
                   help="two variants side by side in one run (leanserve.bench.context_compare): knowledge-qa with "
                        "passage selection off vs on, or customer-service (Zipf over 50 FAQs) with the server's "
                        "answer cache off vs on (the server needs --answer-cache; rates from --sweep)")
    p.add_argument("--top-k-documents", type=int, default=3, help="--compare documents: passages kept when on")
    p.add_argument("--zipf-s", type=float, default=1.0, help="--compare answer-cache: Zipf exponent of the draw")
    p.add_argument("--unique-share", type=float, default=0.3,
                   help="--compare answer-cache: share of requests with a question of their own (never cached)")
    p.add_argument("--no-warmup", action="store_true",
                   help="--compare answer-cache: measure from cold caches (default: one request per FAQ first)")


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of a GGUF file or HF folder (None: the default model's GGUF), without loading weights.

    Raises:
        ModelLoadError: the default model is not installed, or the folder has no usable tokenizer.
        OSError / ValueError: the GGUF file cannot be read.
    """
    if path is not None and os.path.isdir(path):
        return Tokenizer.from_dir(path)
    from leanserve.loader import default_model_path

    import gguf

    return Tokenizer.from_gguf(gguf.GGUFReader(path or default_model_path()))


def _requests_for(args: argparse.Namespace, tokenizer: Tokenizer, corpus: Corpus | None, seed: int
                  ) -> list[BenchRequest]:
    if args.dataset:
        requests = load_dataset(args.dataset, tokenizer, args.num_prompts, seed)
        if len(requests) < args.num_prompts:
            print(f"note: {args.dataset} has {len(requests)} usable requests; sending {len(requests)}, not "
                  f"{args.num_prompts}", file=sys.stderr)
        return requests
    return make_workload(args.workload or "customer-service", corpus, args.num_prompts, seed)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed ``args`` describe; 0 when every request succeeded, 1 otherwise.

    Raises:
        ValueError: bad --goodput, --sweep, --slo-attainment-goal, rate, burstiness, concurrency, timeout or
            metrics-interval values, or an unusable dataset.
        RuntimeError: the server's model list cannot be read.
    """
    slos = parse_goodput(args.goodput)
    rates = parse_rates(args.sweep) if args.sweep is not None else None
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not 0 < args.slo_attainment_goal <= 1:
        raise ValueError(f"--slo-attainment-goal must be in (0, 1], got {args.slo_attainment_goal}")
    config = BenchConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                         request_rate=args.request_rate, burstiness=args.burstiness,
                         max_concurrency=args.max_concurrency, seed=args.seed, slos=slos, api_key=args.api_key,
                         timeout_s=args.timeout, progress=not args.disable_tqdm,
                         metrics_interval_s=args.metrics_interval)
    tokenizer = load_tokenizer(args.tokenizer)
    corpus = None if args.dataset else Corpus.load(tokenizer)
    label = args.workload or ("dataset" if args.dataset else "customer-service")

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    if args.compare is not None:
        return _run_compare(args, config, corpus or Corpus.load(tokenizer), rates, count_tokens)

    if rates is None:
        runs = [run_benchmark(config, _requests_for(args, tokenizer, corpus, args.seed), label, count_tokens)]
        print_run(runs[0])
        payload = runs[0].to_dict()
    else:
        done: list[RunResult] = []

        def on_run(run: RunResult) -> None:  # each run as it ends: an interrupted sweep keeps what it measured
            done.append(run)
            print_run(run)
            sys.stdout.flush()
            if args.result_json:
                write_json(args.result_json, _sweep_payload(done, label, slos, args.slo_attainment_goal))

        runs = run_sweep(config, lambda seed: _requests_for(args, tokenizer, corpus, seed), rates, label,
                         count_tokens, on_run=on_run)
        print_sweep(runs, goal=args.slo_attainment_goal)
        payload = _sweep_payload(runs, label, slos, args.slo_attainment_goal)
    _write_outputs(args, runs, payload, label, sweep=rates is not None)
    return 0 if all(r.metrics.failed == 0 for r in runs) else 1


def _run_compare(args: argparse.Namespace, config: BenchConfig, corpus: Corpus, rates: list[float] | None,
                 count_tokens) -> int:
    from leanserve.bench import context_compare

    if args.compare == "documents":
        rows = context_compare.compare_documents(config, corpus, args.num_prompts, args.seed, args.top_k_documents,
                                                 count_tokens)
        failed = sum(r["failed"] for r in rows.values())
    else:
        if not config.slos:
            raise ValueError("--compare answer-cache needs --goodput SLOs (e.g. ttft:2000) for the sustained rate")
        rows = context_compare.compare_answer_cache(config, corpus, args.num_prompts, args.seed, rates or [math.inf],
                                                    args.slo_attainment_goal, args.zipf_s, count_tokens,
                                                    args.unique_share, not args.no_warmup)
        failed = sum(x["failed"] for r in rows.values() for x in r["runs"])
    context_compare.write(args.result_json, {"compare": args.compare, "rows": rows})
    return 0 if failed == 0 else 1


def _sweep_payload(runs: Sequence[RunResult], label: str, slos: dict[str, float], goal: float) -> dict:
    best = sweep_sustained_rate(runs, goal) if slos else None
    return {"label": label, "summary": sweep_rows(runs), "slo_attainment_goal": goal,
            "max_sustained_rate": "inf" if best is not None and math.isinf(best) else best,
            "runs": [r.to_dict() for r in runs]}


def _write_outputs(args: argparse.Namespace, runs: Sequence[RunResult], payload: dict, label: str,
                   sweep: bool) -> None:
    if args.result_json:
        print(f"wrote {write_json(args.result_json, payload)}")
    if args.plot:
        from leanserve.bench.plot import plot_run, plot_sweep

        if sweep:
            path = plot_sweep({label: {runs[0].model_id: [r.to_dict() for r in runs]}}, args.plot,
                              goal=args.slo_attainment_goal)
        else:
            path = plot_run(runs[0].to_dict(), args.plot)
        print(f"wrote {path}")
    sys.stdout.flush()
