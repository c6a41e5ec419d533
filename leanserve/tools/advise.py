"""``leanserve advise``: read a running server's metrics (and/or ``leanserve bench`` results), report the seed's
metrics as an operator reads them, and rank what to optimize next along the seed's path, with evidence, the exact
change, its expected effect and basis, and its risk; ``--experiment`` tries the top server-flag change on a second
server and reports before / after.

Pieces: :mod:`.advise_metrics` (scraping, the window), :mod:`.advise_snapshot` (the numbers, bench files),
:mod:`.advise_setup` (the observed server's flags), :mod:`.advise_rules` (the rule table) with
:mod:`.advise_advice` and :mod:`.advise_thresholds`, :mod:`.advise_experiment`, :mod:`.advise_report`,
:mod:`.advise_args` (the options).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from leanserve.tools.advise_experiment import Replay, run_experiments
from leanserve.tools.advise_metrics import model_card, sample_window, snapshot_from_window
from leanserve.tools.advise_report import format_text, payload, write_html
from leanserve.tools.advise_rules import recommend
from leanserve.tools.advise_setup import Setup, parse_serve_args
from leanserve.tools.advise_snapshot import Snapshot, load_bench_runs, merge, snapshot_from_bench

# make_replay(workload, num_prompts, request_rate, seed, tokenizer) -> Replay; infer(prompt, output) -> workload
MakeReplay = Callable[[str, int, float, int, str | None], Replay]
InferWorkload = Callable[[float | None, float | None], str]


def _server_root(url: str) -> str:
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _replay_rate(args: argparse.Namespace, runs: list[dict[str, Any]], s: Snapshot) -> float:
    if args.experiment_rate is not None:
        return args.experiment_rate
    rates = {str(r.get("request_rate")) for r in runs}
    if len(rates) == 1:
        rate = rates.pop()
        return math.inf if rate == "inf" else float(rate)
    return s.request_throughput or math.inf


def _check(args: argparse.Namespace) -> None:
    for name in ("duration", "interval"):
        if not getattr(args, name) >= 0 or (name == "interval" and args.interval == 0):
            raise ValueError(f"--{name} must be {'> 0' if name == 'interval' else '>= 0'} s")
    if args.experiment_changes < 1 or args.experiment_prompts < 1:
        raise ValueError("--experiment-changes and --experiment-prompts must be >= 1")
    if args.experiment_rate is not None and not args.experiment_rate > 0:
        raise ValueError("--experiment-rate must be > 0 requests/s")


def run_advise_cli(args: argparse.Namespace, infer_workload: InferWorkload, make_replay: MakeReplay | None = None,
                   out: Any = sys.stdout, log: Callable[[str], None] | None = None) -> int:
    """Run ``leanserve advise`` as the parsed ``args`` say. Returns 0, or 2 when nothing could be read (the
    server answers neither /metrics nor /v1/models and no --bench-json was given).

    ``infer_workload`` maps the observed mean prompt / output tokens to a scenario name; ``make_replay`` builds the
    replay for ``--experiment`` (both from ``leanserve.bench.replay``, handed in by the CLI).

    Raises:
        ValueError: bad options (--serve-args, --duration...) or an unusable --bench-json file.
        OSError: a --bench-json or --html file cannot be read or written.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    _check(args)
    engine, known = parse_serve_args(args.serve_args)
    url = _server_root(args.base_url)
    runs = load_bench_runs(args.bench_json) if args.bench_json else []
    owned_by, model_id, max_len = model_card(url, args.api_key)
    log(f"advise: sampling {url}/metrics for {args.duration:g} s")
    window = sample_window(url, args.duration, args.interval, args.api_key)
    if window is None and owned_by is None and not runs:
        print(f"error: {url} answers neither /metrics nor /v1/models, and no --bench-json was given",
              file=sys.stderr)
        return 2
    live = snapshot_from_window(window, owned_by, model_id, max_len) if window is not None else None
    s = merge(live, snapshot_from_bench(runs) if runs else None)
    if live is None:
        s.server_kind = {"leanserve": "leanserve", "vllm": "vllm", "llamacpp": "llama.cpp"}.get(owned_by or "",
                                                                                            "none")
        s.max_model_len = s.max_model_len or max_len
    workload = args.workload or infer_workload(*(None if d is None else d.mean
                                                 for d in (s.prompt_tokens, s.output_tokens)))
    setup = Setup(engine, known, max_len, url, workload)
    recs = recommend(s, setup)
    experiments = []
    if args.experiment:
        if make_replay is None:
            raise ValueError("--experiment needs a replay (run it through the leanserve command)")
        replay = make_replay(workload, args.experiment_prompts, _replay_rate(args, runs, s), args.experiment_seed,
                             args.tokenizer or engine.model)
        experiments = run_experiments(recs, setup, replay, args.api_key, args.experiment_changes, log=log)
        if not experiments:
            log("experiment: no recommendation is a `leanserve serve` flag change: nothing to try")
    if args.json:
        out.write(json.dumps(payload(s, recs, setup, experiments), indent=2, default=str) + "\n")
    else:
        out.write(format_text(s, recs, setup, experiments) + "\n")
    if args.html:
        log(f"wrote {write_html(args.html, s, recs, setup, experiments)}")
    return 0
