"""Schema-driven fuzzing of the whole API with schemathesis: every operation of the server's ``/openapi.json``
gets generated requests (valid ones, and with ``--negative`` invalid ones too); each response is checked with
schemathesis' ``not_a_server_error`` (no 5xx) and ``response_schema_conformance`` (the body matches the schema
documented for its status). The test suite runs a lean version (tests/entrypoints/test_hardening_openapi.py);
before a release run the long one:

    .venv/bin/python -m benchmarks.fuzz_api --max-examples 300 --negative      # starts its own server
    .venv/bin/python -m benchmarks.fuzz_api --url http://127.0.0.1:8000 --api-key KEY

Generated requests ask for at most ``--max-tokens`` tokens and 2 choices (so a run measures the API, not decode
speed). Loopback addresses only. Exit status 0 when no check failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis import openapi as st_openapi
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance

CHECKS = [not_a_server_error, response_schema_conformance]


@dataclass
class FuzzReport:
    examples: Counter = field(default_factory=Counter)  # per "METHOD /path mode"
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    rejections: Counter = field(default_factory=Counter)  # 4xx of schema-valid requests, by param and message
    elapsed_s: float = 0.0
    out_of_time: bool = False

    @property
    def total(self) -> int:
        return sum(self.examples.values())

    def summary(self) -> dict[str, Any]:
        return {"examples": self.total, "per_operation": dict(self.examples),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "positive_rejected": dict(self.rejections.most_common(15)),
                "failures": len(self.failures), "first_failures": self.failures[:5],
                "elapsed_s": round(self.elapsed_s, 1), "out_of_time": self.out_of_time}


def clamp(body: Any, max_tokens: int) -> None:
    """Keep a generated generation request cheap: at most ``max_tokens`` tokens and 2 choices."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_tokens:
            body[name] = max_tokens
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = max_tokens  # chat without max_tokens would fill the context
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 2:
        body["n"] = 2
    if isinstance(body.get("min_tokens"), int) and not isinstance(body["min_tokens"], bool) and \
            body["min_tokens"] > max_tokens:
        body["min_tokens"] = max_tokens


def fuzz(base_url: str, headers: dict[str, str] | None = None, max_examples: int = 20, time_budget: float = 300.0,
         negative: bool = False, max_tokens: int = 4, seed: int | None = 0) -> FuzzReport:
    """Fuzz every operation of the server at ``base_url``; never raises for a failed check (see the report)."""
    if urlparse(base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("fuzz only loopback servers")
    schema = st_openapi.from_url(f"{base_url}/openapi.json", timeout=60)
    report = FuzzReport()
    t0 = time.monotonic()
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if negative else [])
    operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    for op in operations:
        for mode in modes:
            _fuzz_operation(op, mode, report, base_url, headers, max_examples, t0 + time_budget, max_tokens,
                            seed is not None)
    report.elapsed_s = time.monotonic() - t0
    return report


def _reason(response: Any) -> str:
    try:
        err = response.json()["error"]
    except Exception:  # noqa: BLE001 - not an envelope
        return f"{response.status_code}"
    words = " ".join(str(err.get("message", "")).split()[:5])
    return f"{response.status_code} {err.get('param')}: {words}"


def _fuzz_operation(op: Any, mode: GenerationMode, report: FuzzReport, base_url: str, headers: dict | None,
                    max_examples: int, deadline: float, max_tokens: int, derandomize: bool) -> None:
    label = f"{op.method.upper()} {op.path} {mode.value}"

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(mode))
    def run(case) -> None:
        if time.monotonic() > deadline:
            report.out_of_time = True
            return
        clamp(case.body, max_tokens)
        report.examples[label] += 1
        try:
            response = case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS, timeout=120)
            report.statuses[response.status_code] += 1
            if mode == GenerationMode.POSITIVE and 400 <= response.status_code < 500:
                report.rejections[_reason(response)] += 1
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - a failed check (a FailureGroup), collected
            body = json.dumps(case.body, default=str)[:300] if case.body is not None else ""
            report.failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:500]} | body {body}")

    try:
        run()
    except Unsatisfiable:  # nothing to negate (an operation without parameters or body)
        report.examples[label] += 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (loopback); default: start one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-examples", type=int, default=300, help="per operation and generation mode")
    p.add_argument("--negative", action="store_true", help="also generate invalid requests")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--time-budget", type=float, default=3600.0, help="seconds")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    proc = None
    if args.url is None:
        from benchmarks.soak import start_server

        args.api_key = args.api_key or "fuzz-key"
        server_args = argparse.Namespace(api_key=args.api_key, max_num_seqs=16, max_model_len=1024,
                                         kv_cache_memory=256 << 20, max_request_bytes=1 << 20, server_arg=[])
        proc, url = start_server(server_args)
    else:
        url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    try:
        report = fuzz(url, headers, args.max_examples, args.time_budget, args.negative, args.max_tokens, seed=None)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
