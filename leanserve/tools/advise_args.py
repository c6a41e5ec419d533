"""The options of ``leanserve advise`` (kept apart from :mod:`leanserve.tools.advise` so that building the
``leanserve`` parser imports no plotting or HTTP code)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def add_advise_args(p: argparse.ArgumentParser, workloads: Sequence[str]) -> None:
    """The options of ``leanserve advise`` (``workloads``: the names ``--workload`` accepts)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root; a trailing /v1 is dropped (default: http://127.0.0.1:8000)")
    p.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="seconds to sample /metrics (default 10); with no traffic in them, the counters since the "
                        "server started are used")
    p.add_argument("--interval", type=float, default=0.5, metavar="S", help="seconds between polls (default 0.5)")
    p.add_argument("--bench-json", nargs="+", default=None, metavar="FILE",
                   help="`leanserve bench --result-json` files (runs or sweeps) to read as well")
    p.add_argument("--workload", default=None, choices=list(workloads),
                   help="scenario for commands and --experiment (default: inferred from the observed lengths)")
    p.add_argument("--serve-args", default=None, metavar="FLAGS",
                   help="the flags the observed leanserve server was started with, quoted; one flag alone as "
                        "--serve-args=--FLAG (default: assume leanserve's defaults)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--json", action="store_true", help="print {\"metrics\", \"recommendations\", ...} as JSON")
    p.add_argument("--html", default=None, metavar="FILE", help="write a one-page report with plots")
    p.add_argument("--experiment", action="store_true",
                   help="start a second leanserve server with the top server-flag change, replay the workload on "
                        "both, and report before / after")
    p.add_argument("--experiment-changes", type=int, default=1, metavar="N",
                   help="how many server-flag recommendations to try, in rank order (default 1)")
    p.add_argument("--experiment-prompts", type=int, default=16, metavar="N", help="requests per replay (16)")
    p.add_argument("--experiment-rate", type=float, default=None, metavar="R",
                   help="requests/s of the replay (default: the bench runs' offered rate, else the observed "
                        "request throughput, else all at once)")
    p.add_argument("--experiment-seed", type=int, default=1000,
                   help="seed of the replayed requests (default 1000: other prompts than bench's default seed 0, "
                        "so the observed server's prefix cache does not already hold them)")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder of the served model's tokenizer for the replay (default: the model "
                        "of --serve-args, else the default model's)")
