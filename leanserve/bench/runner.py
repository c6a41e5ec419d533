"""One benchmark run against a server (arrivals, streaming requests, server metrics, statistics) and sweeps."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from leanserve.bench.arrivals import arrival_offsets, dispatch
from leanserve.bench.client import RequestResult, send_request
from leanserve.bench.server_metrics import MetricsPoller, ServerMetricsReport
from leanserve.bench.stats import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics
from leanserve.bench.workloads import BenchRequest

import httpx
from tqdm import tqdm


@dataclass(frozen=True)
class BenchConfig:
    """How to load the server.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is appended; a trailing ``/v1`` is
            dropped, so ``http://host:8000/v1``, the form OpenAI clients take, works too).
        model: model name sent in requests; None: the first id of ``GET /v1/models``.
        endpoint: ``chat`` or ``completions``.
        request_rate: mean arrivals per second (``inf``: all at once).
        burstiness: gamma shape of the gaps (1: Poisson).
        max_concurrency: most requests in flight (None: no cap).
        seed: seed of the arrival times.
        slos: goodput SLOs in milliseconds (``ttft`` / ``tpot`` / ``e2el``).
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: per-request timeout in seconds.
        progress: show a tqdm progress bar.
        metrics_interval_s: seconds between /metrics polls.
        percentiles: percentiles reported for each latency.
    """

    base_url: str
    model: str | None = None
    endpoint: str = "chat"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    api_key: str | None = None
    timeout_s: float = 3600.0
    progress: bool = True
    metrics_interval_s: float = 0.5
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES

    def __post_init__(self) -> None:
        """Raises ValueError on settings no run can use (checked before anything is sent)."""
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 s, got {self.timeout_s}")
        if not self.metrics_interval_s > 0:
            raise ValueError(f"--metrics-interval must be > 0 s, got {self.metrics_interval_s}")

    @property
    def server_root(self) -> str:
        """``base_url`` without a trailing ``/`` or ``/v1``."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass
class RunResult:
    """A finished run: its settings, the metrics, the server's view and every request's result."""

    config: BenchConfig
    model_id: str
    label: str
    metrics: BenchmarkMetrics
    server: ServerMetricsReport | None
    results: list[RequestResult]
    date: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with vLLM ``bench serve``'s field names (``request_rate`` ``"inf"`` when unbounded),
        ``server_metrics`` (or None) and the per-request lists ``input_lens``, ``output_lens``, ``ttfts``
        (seconds), ``itls`` (seconds), ``start_times`` (seconds) and ``errors``."""
        c = self.config
        rate = "inf" if math.isinf(c.request_rate) else c.request_rate
        return {
            "date": self.date, "backend": "openai-chat" if c.endpoint == "chat" else "openai", "label": self.label,
            "base_url": c.base_url, "endpoint_type": c.endpoint, "model_id": self.model_id,
            "num_prompts": len(self.results), "request_rate": rate, "burstiness": c.burstiness,
            "max_concurrency": c.max_concurrency, "goodput_slos_ms": dict(c.slos) or None,
            **self.metrics.to_dict(),
            "server_metrics": dataclasses.asdict(self.server) if self.server else None,
            "input_lens": [r.prompt_tokens for r in self.results],
            "output_lens": [r.output_tokens for r in self.results],
            "ttfts": [r.ttft for r in self.results],
            "itls": [r.itl for r in self.results],
            "e2els": [r.latency for r in self.results],
            "start_times": [r.start for r in self.results],
            "errors": [r.error for r in self.results],
        }


async def first_model_id(client: httpx.AsyncClient) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        RuntimeError: the server did not answer 200 with at least one model.
    """
    try:
        resp = await client.get("/v1/models", timeout=30.0)
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"cannot list models at {client.base_url}/v1/models: {type(exc).__name__}: {exc}"
                           ) from exc
    if not data:
        raise RuntimeError(f"GET {client.base_url}/v1/models answered {resp.status_code}: {resp.text[:300]}")
    return str(data[0]["id"])


async def run_benchmark_async(config: BenchConfig, requests: Sequence[BenchRequest], label: str = "",
                              count_tokens: Callable[[str], int] | None = None) -> RunResult:
    """Send ``requests`` to the server as ``config`` says and measure them.

    Raises:
        RuntimeError: the model list cannot be read (when ``config.model`` is None).
        ValueError: bad rate, burstiness or concurrency (see :func:`arrival_offsets`, :func:`dispatch`).
    """
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    # /metrics is polled on a client of its own, so --max-concurrency's connection cap never delays a poll and a
    # poll never takes a request's connection
    async with httpx.AsyncClient(base_url=config.server_root, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout_s, connect=30.0)) as client, \
            httpx.AsyncClient(base_url=config.server_root, headers=headers) as metrics_client:
        model = config.model or await first_model_id(client)
        offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
        poller = MetricsPoller(metrics_client, config.metrics_interval_s)
        await poller.start()
        date = time.strftime("%Y%m%d-%H%M%S")
        bar = tqdm(total=len(requests), disable=not config.progress, desc=label or "requests", unit="req")
        start = time.perf_counter()

        async def send(req: BenchRequest) -> RequestResult:
            return await send_request(client, req, model, config.endpoint, start, count_tokens)

        results = await dispatch(requests, send, offsets, config.max_concurrency, on_done=lambda _: bar.update(1))
        duration = time.perf_counter() - start
        bar.close()
        server = await poller.stop()
    metrics = compute_metrics(results, duration, config.slos, config.percentiles)
    return RunResult(config, model, label, metrics, server, results, date)


def run_benchmark(config: BenchConfig, requests: Sequence[BenchRequest], label: str = "",
                  count_tokens: Callable[[str], int] | None = None) -> RunResult:
    """Synchronous :func:`run_benchmark_async` (runs its own event loop)."""
    return asyncio.run(run_benchmark_async(config, requests, label, count_tokens))


def run_sweep(config: BenchConfig, make_requests: Callable[[int], Sequence[BenchRequest]], rates: Sequence[float],
              label: str = "", count_tokens: Callable[[str], int] | None = None,
              on_run: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """One run per rate (requests per second), in order. Run ``i`` sends ``make_requests(config.seed + i)``, so that
    a prefix cache warmed by one run does not serve the next run's prompts. ``on_run`` is called with each run as
    it finishes (to print it and save partial results: a long sweep that is interrupted keeps what it measured).

    Raises:
        ValueError: ``rates`` is empty or a rate is not positive.
    """
    if not rates:
        raise ValueError("a sweep needs at least one rate")
    runs = []
    for i, rate in enumerate(rates):
        cfg = dataclasses.replace(config, request_rate=rate, seed=config.seed + i)
        name = f"{label} rate={rate:g}".strip()
        runs.append(run_benchmark(cfg, make_requests(config.seed + i), name, count_tokens))
        if on_run is not None:
            on_run(runs[-1])
    return runs


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,inf"`` -> ``[0.5, 1.0, 2.0, inf]`` (requests per second).

    Raises:
        ValueError: an item is not a positive number or ``inf``.
    """
    rates = []
    for item in text.split(","):
        item = item.strip()
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"bad rate {item!r} in {text!r}: expected numbers or inf") from None
        if not rate > 0:
            raise ValueError(f"rates must be > 0 requests/s, got {item!r}")
        rates.append(rate)
    return rates
