"""The fleet's health and metrics, without Ray: probe every replica, take failing ones out of routing and back
in, answer the fleet's ``/health``, and merge the replicas' ``/metrics`` under a ``replica`` label.

A replica's probe is its own ``GET /health`` (:func:`~leanserve.entrypoints.openai.api_server.build_app`: 200 only
while its engine loop runs and advances), so the fleet's health reflects the engine loops, not only processes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from leanserve.entrypoints.ray_serve.router import Router

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

Probe = Callable[[str], Awaitable[tuple]]  # name -> (healthy, detail) or (healthy, detail, info dict)


@dataclass
class ReplicaHealth:
    healthy: bool = True
    detail: str = "starting"
    since: float = 0.0  # time.monotonic() of the last change
    failures: int = 0  # times it was taken out of routing
    info: dict | None = None  # what the last passing probe told (e.g. the replica's pid)
    failed_probes: int = 0  # consecutive failed probes


class FleetMonitor:
    """Probes each replica every ``interval`` s (each probe bounded by ``timeout`` s: a hung replica fails it)
    and keeps the router's health marks in step: ``probe_failures`` failed probes in a row take a replica out
    (one slow answer on a busy machine does not), a failed call (:meth:`mark`) at once; a passing probe brings it
    back.

    Args:
        router: the replica states whose ``healthy`` marks this monitor sets.
        probe: ``probe(name) -> (healthy, detail[, info])``; an exception or a timeout counts as unhealthy.
    """

    def __init__(self, router: Router, probe: Probe, interval: float = 1.0, timeout: float = 3.0,
                 probe_failures: int = 2) -> None:
        self.router = router
        self.probe_failures = probe_failures
        self.probe = probe
        self.interval = interval
        self.timeout = timeout
        now = time.monotonic()
        self.replicas: dict[str, ReplicaHealth] = {n: ReplicaHealth(since=now) for n in router.replicas}
        self._task: asyncio.Task | None = None

    def mark(self, name: str, healthy: bool, detail: str, info: dict | None = None) -> None:
        """Record a replica's health (from a probe, or a failed call: ``healthy`` False) and route accordingly."""
        state = self.replicas[name]
        if state.healthy != healthy:
            state.since = time.monotonic()
            if not healthy and state.detail != "starting":
                state.failures += 1
        state.healthy = healthy
        state.detail = detail
        if info is not None:
            state.info = info
        self.router.set_healthy(name, healthy)

    async def probe_once(self) -> None:
        async def one(name: str) -> None:
            info = None
            try:
                healthy, detail, *rest = await asyncio.wait_for(self.probe(name), self.timeout)
                info = rest[0] if rest else None
            except TimeoutError:
                healthy, detail = False, f"no answer within {self.timeout:g} s"
            except Exception as exc:
                healthy, detail = False, f"{type(exc).__name__}: {exc}"[:300]
            state = self.replicas[name]
            state.failed_probes = 0 if healthy else state.failed_probes + 1
            if healthy or state.failed_probes >= self.probe_failures or not state.healthy:
                self.mark(name, healthy, detail, info)

        await asyncio.gather(*(one(n) for n in self.replicas))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def report(self) -> tuple[int, dict]:
        """The fleet's ``/health``: (status, body). 200 ``"ok"`` when every replica is healthy, 200
        ``"degraded"`` when some are (the fleet still serves), 503 ``"unavailable"`` when none is."""
        healthy = [n for n, s in self.replicas.items() if s.healthy]
        status = "ok" if len(healthy) == len(self.replicas) else "degraded" if healthy else "unavailable"
        now = time.monotonic()
        body = {"status": status, "healthy_replicas": len(healthy), "replicas": {
            n: {"healthy": s.healthy, "detail": s.detail, "for_s": round(now - s.since, 3), "failures": s.failures,
                "in_flight": self.router.replicas[n].in_flight, "routed": self.router.replicas[n].routed,
                **(s.info or {})}
            for n, s in self.replicas.items()}}
        return (503 if status == "unavailable" else 200), body


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merge_metrics(texts: Mapping[str, str | None], label: str = "replica") -> str:
    """One Prometheus text exposition of several replicas' ``/metrics`` (text format 0.0.4): every sample gets
    ``label="<name>"`` first among its labels, each metric family once (its ``# HELP`` / ``# TYPE`` from the first
    replica, then the samples of every replica, grouped as the format requires). A replica whose text is None (it
    did not answer) is left out."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for name, text in texts.items():
        if text is None:
            continue
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if family not in samples:
                    headers[family], samples[family] = [], []
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            metric, labels, rest = m.groups()
            tag = f'{label}="{_escape(name)}"'
            if family not in samples:
                headers[family], samples[family] = [], []
            samples[family].append(f"{metric}{{{tag}{',' + labels if labels else ''}}}{rest}")
    lines = [line for fam in samples for line in (*headers[fam], *samples[fam])]
    return "\n".join(lines) + "\n" if lines else ""


class RouterMetrics:
    """The ingress's own metrics: requests routed, retried, in flight, healthy, per replica; routing time."""

    def __init__(self, names: Sequence[str]) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter("leanserve:router_requests", "requests routed to each replica (retries included)",
                              ["replica"], registry=self.registry)
        self.in_flight = Gauge("leanserve:router_requests_in_flight", "requests in flight per replica, as the "
                               "router counts them", ["replica"], registry=self.registry)
        self.healthy = Gauge("leanserve:replica_healthy", "1 while the replica is in routing", ["replica"],
                             registry=self.registry)
        self.retried = Counter("leanserve:router_retries", "requests retried on another replica after a failure "
                               "before their first byte", registry=self.registry)
        self.route_seconds = Counter("leanserve:router_decision_seconds", "time spent choosing replicas",
                                     registry=self.registry)
        for n in names:
            self.routed.labels(n)
            self.in_flight.labels(n)
            self.healthy.labels(n)

    def render(self, router: Router, num_retried: int, route_seconds: float) -> str:
        for n, s in router.replicas.items():
            self.routed.labels(n)._value.set(s.routed)
            self.in_flight.labels(n).set(s.in_flight)
            self.healthy.labels(n).set(1 if s.healthy else 0)
        self.retried._value.set(num_retried)
        self.route_seconds._value.set(route_seconds)
        return "".join(line + "\n" for line in generate_latest(self.registry).decode().splitlines()
                       if "_created" not in line)
