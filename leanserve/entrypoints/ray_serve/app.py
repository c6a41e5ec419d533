"""``leanserve serve --replicas N``: a Ray Serve application of N engine replicas behind one OpenAI API.

Deployments (one Ray Serve application, ``route_prefix="/"``):

- ``engine-0`` .. ``engine-{N-1}``: one deployment of one replica each (:class:`EngineReplica`): an
  ``AsyncEngine`` with its own ``--threads`` and KV pool, served by the unchanged
  :func:`~leanserve.entrypoints.openai.api_server.build_app` (errors, auth, tenants, limits, per-replica
  ``/health`` and ``/metrics``), called in-process by :mod:`.asgi_bridge` and streamed back message by message
  (``DeploymentHandle.options(stream=True)``). Ray restarts a replica whose process dies or whose
  ``check_health`` fails (its engine loop dead or stalled).
- ``ingress`` (:class:`FleetIngress`): Ray Serve's HTTP proxy hands it every request; it routes generation
  requests with the ``--replica-router`` policy (:mod:`.router`), proxies everything else, streams the replica's
  chunks through as they come (:mod:`.proxy`), answers the fleet's ``/health`` and the merged ``/metrics``
  (:mod:`.fleet`).

Why routing lives in the ingress and not in a Ray Serve custom ``RequestRouter`` (``request_router_config``): the
cache-aware policy must see the prompt (the router API gets the pending request's arguments, but its state would
live in every caller's handle), must count load until the *response* ends, streaming or not, aborted or failed
(the request router is told when a request is assigned, not when a stream the ingress consumes ends), and must
pick a replica a retry has not tried yet. One deployment per engine gives the ingress one handle per replica, so
the policy of :mod:`.router` decides exactly, and Ray still places, restarts and drains every replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from leanserve.config import EngineConfig, ServerConfig
from leanserve.engine.async_engine import SHUTTING_DOWN, AsyncEngine
from leanserve.engine.llm_engine import LLMEngine
from leanserve.entrypoints.openai.api_server import app_options, build_app, default_served_model_name
from leanserve.entrypoints.openai.gate import DRAIN_RETRY_AFTER_S
from leanserve.entrypoints.openai.tenants import TenantLimits, TenantRegistry
from leanserve.entrypoints.ray_serve.asgi_bridge import call_asgi
from leanserve.entrypoints.ray_serve.fleet import FleetMonitor, RouterMetrics, merge_metrics
from leanserve.entrypoints.ray_serve.proxy import Dispatcher, ProxiedResponse, gather_texts, routing_hashes
from leanserve.entrypoints.ray_serve.router import make_router

import ray
import starlette.responses
from ray import serve

logger = logging.getLogger(__name__)

APP_NAME = "leanserve"
ACCEPT_TIMEOUT_S = 5.0  # a replica call that has not even started by then counts as a failed replica
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
MAX_ONGOING = 4096  # Ray Serve's per-replica queue bound: the engines batch and bound their own queues
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Ray Serve's per-call log lines off


class EngineReplica:
    """One engine and its OpenAI app, as a Ray Serve replica."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, name: str) -> None:
        sc = server_config
        self.name = name
        defaults = TenantLimits(sc.tenant_max_concurrent, sc.tenant_requests_per_minute, sc.tenant_tokens_per_minute)
        tenants = TenantRegistry.from_config(sc.api_keys, sc.api_keys_file, defaults)
        llm_engine = LLMEngine(engine_config)
        self.engine = AsyncEngine(llm_engine, max_waiting=sc.max_waiting, request_timeout=sc.request_timeout)
        self.served_name = sc.served_model_name or default_served_model_name(llm_engine.model_path)
        self.stall_timeout = sc.engine_stall_timeout
        self.app = build_app(self.engine, self.served_name, tenants=tenants, **app_options(sc))

    async def proxy(self, request: dict[str, Any]):
        """The app's response to ``request`` (method, path, query, headers, body), message by message; the first
        message, ``{"type": "accepted"}``, tells the ingress the replica has the request."""
        yield {"type": "accepted"}
        async for message in call_asgi(self.app, request["method"], request["path"], request.get("query", b""),
                                       request.get("headers", ()), request.get("body", b"")):
            yield message

    async def health(self) -> tuple[bool, str, dict]:
        """The replica's own ``GET /health``: (healthy, detail, {"pid": its process id})."""
        status, body = 0, b""
        async for message in call_asgi(self.app, "GET", "/health"):
            if message["type"] == "start":
                status = message["status"]
            elif message["type"] == "body":
                body += message["body"]
        return (status == 200, "ok" if status == 200 else body.decode(errors="replace")[:300],
                {"pid": os.getpid()})

    async def fetch_metrics(self) -> str:
        body = b""
        async for message in call_asgi(self.app, "GET", "/metrics"):
            if message["type"] == "body":
                body += message["body"]
        return body.decode()

    def check_health(self) -> None:
        """Ray Serve's health check: a dead or stalled engine loop fails it (Ray then restarts the replica)."""
        if not self.engine.is_running:
            raise RuntimeError(f"{self.name}: the engine is not running ({self.engine.dead!r})")
        stalled = self.engine.stalled_for()
        if stalled > self.stall_timeout:
            raise RuntimeError(f"{self.name}: the engine loop has not advanced for {stalled:.1f} s")

    def pid(self) -> int:
        return os.getpid()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class FleetIngress:
    """The HTTP entry of the fleet (see the module docstring)."""

    def __init__(self, replicas: dict[str, Any], policy: str) -> None:
        self.handles = replicas  # name -> DeploymentHandle
        self.names = list(replicas)
        self.router = make_router(policy, self.names)
        self.policy = policy
        self.monitor = FleetMonitor(self.router, self._probe, PROBE_INTERVAL_S, PROBE_TIMEOUT_S)
        self.dispatcher = Dispatcher(self.router, self._call, on_failure=self._failed)
        self.metrics = RouterMetrics(self.names)
        self.draining = False

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503 + Retry-After, ``/health`` 503) and let the in-flight ones finish."""
        self.draining = True

    def num_in_flight(self) -> int:
        return sum(s.in_flight for s in self.router.replicas.values())

    def _failed(self, name: str, exc: BaseException) -> None:
        logger.warning("replica %s failed: %r; taken out of routing until its health probe passes", name, exc)
        self.monitor.mark(name, False, f"call failed: {type(exc).__name__}: {exc}"[:300])

    async def _probe(self, name: str) -> tuple:
        return await self.handles[name].health.remote()

    async def _call(self, name: str, request: dict[str, Any]):
        gen = self.handles[name].options(stream=True).proxy.remote(request)
        try:
            first = await asyncio.wait_for(anext(gen), ACCEPT_TIMEOUT_S)
            if first.get("type") != "accepted":
                yield first
            async for message in gen:
                yield message
        except TimeoutError:
            raise ConnectionError(f"replica {name} did not accept the request within {ACCEPT_TIMEOUT_S:g} s") from None
        finally:
            gen.cancel()

    async def check_health(self) -> None:
        self.monitor.start()  # Ray calls this soon after start: the probes begin without waiting for a request

    async def __call__(self, request: starlette.requests.Request):
        self.monitor.start()
        path = request.url.path
        if self.draining and path != "/metrics":
            return _StarletteProxied(ProxiedResponse.error(503, SHUTTING_DOWN, "server_shutting_down",
                                                           DRAIN_RETRY_AFTER_S))
        if path == "/health" and request.method == "GET":
            status, body = self.monitor.report()
            if status != 200:
                body = {"error": {"message": "no replica of the fleet is healthy", "type": "server_error",
                                  "param": None, "code": "no_healthy_replica"}, **body}
            return starlette.responses.JSONResponse(body, status_code=status)
        if path == "/metrics" and request.method == "GET":
            texts = await gather_texts(self.names, lambda n: self.handles[n].fetch_metrics.remote(), PROBE_TIMEOUT_S)
            own = self.metrics.render(self.router, self.dispatcher.num_retried, self.dispatcher.route_seconds)
            return starlette.responses.Response(merge_metrics(texts) + own,
                                                media_type="text/plain; version=0.0.4; charset=utf-8")
        body = await request.body()
        req = {"method": request.method, "path": path, "query": request.url.query.encode(),
               "headers": [(k, v) for k, v in request.headers.items() if k.lower() != "host"], "body": body}
        t0 = time.perf_counter()
        hashes = routing_hashes(path, body) if self.policy == "cache_aware" else []
        self.dispatcher.route_seconds += time.perf_counter() - t0  # hashing counts as the router's time
        return _StarletteProxied(await self.dispatcher.dispatch(req, hashes))


class _StarletteProxied(starlette.responses.Response):
    """A :class:`~.proxy.ProxiedResponse` that Ray Serve recognizes as a response object (and so sends over
    ASGI as it is: chunk by chunk)."""

    def __init__(self, inner: ProxiedResponse) -> None:  # no Response.__init__: no body to render
        self.inner = inner
        self.status_code = inner.status
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await self.inner(scope, receive, send)


def replica_names(n: int) -> list[str]:
    return [f"engine-{i}" for i in range(n)]


def build_fleet_app(engine_config: EngineConfig, server_config: ServerConfig):
    """The bound Ray Serve application (replicas + ingress) of ``server_config.replicas`` engines."""
    threads = engine_config.num_threads or 1
    replica_dep = serve.deployment(EngineReplica, max_ongoing_requests=MAX_ONGOING, health_check_period_s=2.0,
                                   health_check_timeout_s=5.0,
                                   graceful_shutdown_timeout_s=max(1.0, server_config.shutdown_timeout),
                                   logging_config=QUIET, ray_actor_options={"num_cpus": threads})
    handles = {n: replica_dep.options(name=n).bind(engine_config, server_config, n)
               for n in replica_names(server_config.replicas)}
    ingress = serve.deployment(FleetIngress, name="ingress", max_ongoing_requests=MAX_ONGOING,
                               health_check_period_s=2.0, logging_config=QUIET,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(handles, server_config.replica_router)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _drain(timeout: float, interrupted: threading.Event) -> None:
    """New requests get 503 while the in-flight ones get up to ``timeout`` s to finish."""
    ingress = serve.get_deployment_handle("ingress", APP_NAME)
    ingress.begin_drain.remote().result()
    deadline = time.monotonic() + timeout
    n = ingress.num_in_flight.remote().result()
    print(f"leanserve: SIGTERM: draining {n} in-flight request(s), up to {timeout:g} s (new requests get 503; "
          "a second signal ends at once)", flush=True)
    while n and time.monotonic() < deadline and not interrupted.wait(0.1):
        n = ingress.num_in_flight.remote().result()
    if n:
        print(f"leanserve: shutdown timeout: {n} request(s) still in flight are cut", flush=True)


def _can_listen(host: str, port: int) -> bool:
    """Whether nothing listens on (host, port) now (a plain bind, without SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _app_running() -> bool:
    """Whether the joined Ray cluster already runs an application named ``APP_NAME``."""
    try:
        return APP_NAME in serve.status().applications
    except Exception:  # Serve not started on that cluster
        return False


def run_fleet(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Start (or join, with ``--ray-address``) Ray, deploy the fleet, serve until SIGINT/SIGTERM, then shut the
    application down. SIGTERM drains first: new requests get 503 while the in-flight ones get up to
    ``--shutdown-timeout`` s (a second signal ends at once). Returns 0."""
    sc = server_config
    logging.basicConfig(level=getattr(logging, sc.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report sent from the user's machine
    port = sc.port or _free_port(sc.host)
    if sc.port and not _can_listen(sc.host, port):  # Ray's proxy would share it (SO_REUSEPORT) with another
        print(f"error: cannot listen on {sc.host}:{port}: address already in use", file=sys.stderr)
        return 2
    threads = engine_config.num_threads or 1
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    if sc.ray_address:
        ray.init(address=sc.ray_address, runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    else:  # logical CPUs: enough for every replica's threads (Ray only accounts; the OS shares the cores)
        ray.init(num_cpus=max(os.cpu_count() or 1, sc.replicas * threads + 1), include_dashboard=False,
                 runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    t_ray = time.monotonic()
    if sc.ray_address and _app_running():  # serve.run would replace it, and our shutdown would end it
        print(f"error: a {APP_NAME!r} application already runs on the Ray cluster at {sc.ray_address}; "
              "stop it first (one leanserve fleet per cluster)", file=sys.stderr)
        ray.shutdown()
        return 2
    serve.start(http_options={"host": sc.host, "port": port}, logging_config=QUIET)
    serve.run(build_fleet_app(engine_config, sc), name=APP_NAME, route_prefix="/", blocking=False)
    t_up = time.monotonic()
    shown = f"[{sc.host}]" if ":" in sc.host else sc.host
    url = f"http://{shown}:{port}"
    print(f"leanserve: serving {sc.replicas} replicas ({sc.replica_router} router) on {url}  (OpenAI API under "
          f"{url}/v1, fleet health at {url}/health, metrics at {url}/metrics; Ray up in {t_ray - t0:.1f} s, "
          f"application in {t_up - t_ray:.1f} s; Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(sig, frame) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not stop.wait(0.5):
        pass
    if signals[0] == signal.SIGTERM and sc.shutdown_timeout > 0:
        stop.clear()  # a second signal ends the drain at once
        _drain(sc.shutdown_timeout, stop)
    print("leanserve: shutting the fleet down (draining the replicas)", flush=True)
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
    print("leanserve: server stopped", flush=True)
    return 0
