"""The OpenAI-compatible HTTP server: FastAPI app factory (:func:`build_app`) and runner (:func:`run_server`).

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``. Several models (one engine each) are
served by name: ``served_models.ServedModels`` resolves each request's ``"model"``. Every error is an OpenAI error
envelope ``{"error": {"message", "type", "param", "code"}}`` (never HTML); with API keys (tenants), every endpoint
but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``.

Hardening (see ``gate.py``, ``limits.py``, ``tenants.py``, ``openapi.py``): bodies are bounded in size, nesting
and list lengths; tenants have their own keys and limits; ``/health`` fails while the engine loop is stalled or
dead and while draining; SIGTERM drains (new requests 503, in-flight ones get up to ``--shutdown-timeout`` s to
finish, the rest are aborted, exit 0); a second signal ends at once; an engine that dies makes the server exit 1.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from leanserve.config import EngineConfig, ServerConfig
from leanserve.engine.async_engine import SHUTTING_DOWN, AsyncEngine
from leanserve.engine.llm_engine import LLMEngine
from leanserve.engine.step_lock import StepLock
from leanserve.entrypoints.openai import openapi
from leanserve.entrypoints.openai.answer_cache import ServingAnswerCache
from leanserve.entrypoints.openai.context_policies import ContextSettings
from leanserve.entrypoints.openai.gate import DRAIN_RETRY_AFTER_S, InternalErrorGuard, ServerGate
from leanserve.entrypoints.openai.limits import LimitExceeded, RequestLimits
from leanserve.entrypoints.openai.metrics import ServerMetrics, TenantMetrics
from leanserve.entrypoints.openai.model_routing import build_policies, build_routers, router_specs, serve_routed
from leanserve.entrypoints.openai.models_config import (  # noqa: F401  (default_served_model_name: re-exported)
    ModelSpec,
    default_served_model_name,
    served_names,
)
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from leanserve.entrypoints.openai.served_models import ServedModel, ServedModels, model_not_found
from leanserve.entrypoints.openai.serving_chat import OpenAIServingChat
from leanserve.entrypoints.openai.serving_common import (
    ARRIVAL_KEY,
    OpenAIError,
    bad_request,
    parse_body,
    to_openai_error,
)
from leanserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from leanserve.entrypoints.openai.tenants import TENANT_KEY, TenantLimits, TenantRegistry
from leanserve.errors import InvalidParameterError
from leanserve.routing import RouterSpec
from leanserve.structured.tools import render_messages

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ArrivalTimeMiddleware:
    """Stamps ``scope[ARRIVAL_KEY] = time.monotonic()`` as soon as a request's headers are parsed, so TTFT and
    queue time count from the HTTP request's arrival."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL_KEY] = time.monotonic()
        await self.app(scope, receive, send)


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(engine: AsyncEngine | Mapping[str, AsyncEngine], served_model_name: str | None = None,
              api_key: str | None = None, *,
              tenants: TenantRegistry | None = None, limits: RequestLimits | None = None,
              stall_timeout: float = 10.0, context: ContextSettings | None = None,
              answer_cache_bytes: int | None = None, answer_cache_ttl: float = 600.0,
              answer_cache_semantic: bool = False, answer_cache_similarity: float = 0.9,
              routers: Sequence[RouterSpec] = (), router_policies: dict | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``served_model_name``, or several models: a
    mapping of served name -> engine (each its own engine thread and KV pool; ``served_model_name`` unused; the
    first is the default). Requests pick theirs by ``"model"`` (:class:`ServedModels`; unknown: 404).

    Args:
        api_key: one key for everyone (tenant ``default``); ignored when ``tenants`` is given.
        tenants: the tenants (keys, limits); None and no ``api_key``: no authentication.
        limits: bounds on request bodies (default :class:`RequestLimits`).
        stall_timeout: ``/health`` fails when the engine loop has been busy this many seconds without advancing.
        context: server-wide defaults of the context policies (``context_policies.py``); None: all off.
        answer_cache_bytes: size bound of the exact answer cache (``answer_cache.py``); None: no answer cache.
        answer_cache_ttl: seconds an answer stays valid in it.
        answer_cache_semantic: also match similar last user messages (at ``answer_cache_similarity``).
        routers: router models (``model_routing.py``), each served as a virtual model name over two of the models.
        router_policies: their policies, built already (``model_routing.build_policies``); None: built here.

    The app has one metrics registry (each model's series labelled ``model_name``; its metrics registered as an
    observer of its engine); its lifespan shuts the engines down when the server stops. Gate, limits and tenants
    are per server (the tenants' series carry the default model's name).
    """
    engines = dict(engine) if isinstance(engine, Mapping) else {served_model_name: engine}
    if not engines or any(not isinstance(n, str) or not n for n in engines):
        raise ValueError("build_app needs at least one engine, each under a non-empty served model name")
    registry = CollectorRegistry()
    top = max(e.max_model_len for e in engines.values())  # one set of token-count buckets for every model
    models = ServedModels()
    for name, eng in engines.items():
        metrics = ServerMetrics(name, eng.stats, top, registry)
        eng.add_observer(metrics)
        cache = None if answer_cache_bytes is None else ServingAnswerCache(
            name, answer_cache_bytes, answer_cache_ttl, registry, answer_cache_semantic, answer_cache_similarity)
        models.add(ServedModel(name, eng, OpenAIServingChat(eng, name), OpenAIServingCompletion(eng, name), metrics,
                               cache))
    default = models.default
    engine, served_model_name, metrics = default.engine, default.name, default.metrics
    served_routers = build_routers(routers, registry, router_policies, models)
    for r in served_routers.values():  # /tokenize and /detokenize of a router name use its cheap model's tokenizer
        models.add_virtual(r.name, lambda registry, body, cheap=r.spec.cheap: registry.get(cheap))
    if tenants is None and api_key:
        tenants = TenantRegistry([("default", api_key, TenantLimits())])
    if tenants is not None:
        tenants.metrics = TenantMetrics(registry, served_model_name, [t.name for t in tenants.tenants])
        for eng in models.engines:
            eng.add_observer(tenants)
    limits = limits or RequestLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(models.shutdown)

    app = FastAPI(title="leanserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of leanserve (plus vLLM's extension fields, /tokenize and "
                  "/detokenize). Errors are OpenAI error envelopes.")
    app.state.engine = engine  # the default model's
    app.state.models = models
    app.state.routers = served_routers
    app.state.metrics = metrics
    app.state.tenants = tenants
    app.state.limits = limits
    app.state.context = context or ContextSettings()
    app.state.answer_cache = default.answer_cache
    app.add_middleware(InternalErrorGuard)
    app.add_middleware(ServerGate, engine=models if len(models) > 1 else engine, limits=limits, tenants=tenants)
    app.add_middleware(ArrivalTimeMiddleware)
    vocab = max(getattr(m.engine.tokenizer, "vocab_size", 0) or 0 for m in models) or None
    openapi.install(app, served_model_name if len(models) == 1 and not served_routers
                    else models.names + list(served_routers), limits, vocab)

    def served(request_model: str | None, raw_request: Request, body: Any = None) -> ServedModel:
        """The request's model (404 envelope when unknown); its answer cache goes in ``request.state``."""
        model = models.resolve(request_model, body)
        raw_request.state.answer_cache = model.answer_cache
        return model

    def pinned(req: Any, model: ServedModel) -> Any:
        """``req`` naming ``model`` itself (a virtual name resolved to it), as the serving objects check."""
        return req if req.model is None or req.model == model.name else req.model_copy(update={"model": model.name})

    async def generate(raw_request: Request, request_type: type, create: Callable) -> Response:
        """Parse a chat / completion request and serve it by the model it names, or by its router's choice;
        ``create(model, req)`` runs the model's serving object."""
        req = await parse_body(raw_request, request_type)
        router = served_routers.get(req.model) if req.model else None
        if router is not None:
            return await serve_routed(router, req, raw_request, models, create)
        model = served(req.model, raw_request, req)
        return await create(model, pinned(req, model))

    async def require_api_key(request: Request) -> None:
        if tenants is None:
            return
        if TENANT_KEY in request.scope:  # resolved by the gate
            tenant = request.scope[TENANT_KEY]
        else:
            tenant = tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            raise OpenAIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                              "invalid_request_error", None, "invalid_api_key")

    auth = [Depends(require_api_key)]
    generation_errors = (400, 401, 404, 408, 413, 429, 500, 503)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = [str(x) for x in errors[0].get("loc", ())] if errors else []
        loc = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
        message = f"{'.'.join(loc)}: {errors[0].get('msg')}" if errors else "invalid request"
        return _error_response(bad_request(message, loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = OpenAIError(exc.status_code, str(exc.detail), kind, None, None, dict(exc.headers or {}) or None)
        return _error_response(err)

    @app.exception_handler(LimitExceeded)
    async def _limit_error(request: Request, exc: LimitExceeded) -> JSONResponse:
        return _error_response(to_openai_error(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(to_openai_error(exc))

    @app.api_route("/health", methods=["GET", "HEAD"], response_class=Response, responses={
        200: {"description": "the engine loop is alive and the server accepts requests (empty body)",
              "content": {}},
        503: {"model": ErrorResponse, "description": "the engine is dead, stalled, or the server is draining"}})
    async def health() -> Response:
        several = len(models) > 1
        for m in models:
            eng, which = m.engine, f" of model {m.name}" if several else ""
            if eng.draining and eng.is_running:
                return _error_response(OpenAIError(503, SHUTTING_DOWN, "server_error", None, "server_shutting_down",
                                                   {"Retry-After": str(DRAIN_RETRY_AFTER_S)}))
            if not eng.is_running:
                return _error_response(OpenAIError(503, f"the engine{which} is not running", "server_error"))
            stalled = eng.stalled_for()
            if stalled > stall_timeout:
                return _error_response(OpenAIError(
                    503, f"the engine loop{which} has not advanced for {stalled:.1f} s (limit {stall_timeout:g} s)",
                    "server_error", None, "engine_stalled"))
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=Response, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth, responses=openapi.responses(ModelList, errors=(401, 503)))
    async def list_models() -> JSONResponse:
        cards = [card(m) for m in models] + [ModelCard(id=r.name, owned_by="leanserve-router")
                                             for r in served_routers.values()]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    # OpenAI's retrieve-model endpoint; left out of /openapi.json, whose path set the existing tests pin
    @app.get("/v1/models/{model_id:path}", dependencies=auth, include_in_schema=False)
    async def retrieve_model(model_id: str) -> JSONResponse:
        model = models.get(model_id)
        if model is None:
            if model_id in served_routers:
                return JSONResponse(ModelCard(id=model_id, owned_by="leanserve-router").model_dump(mode="json"))
            raise model_not_found(model_id)
        return JSONResponse(card(model).model_dump(mode="json"))

    @app.post("/v1/chat/completions", dependencies=auth, openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.responses(ChatCompletionResponse, ChatCompletionChunk, generation_errors))
    async def chat_completions(raw_request: Request) -> Response:
        return await generate(raw_request, ChatCompletionRequest, lambda m, r: m.chat.create(r, raw_request))

    @app.post("/v1/completions", dependencies=auth, openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.responses(CompletionResponse, CompletionStreamResponse, generation_errors))
    async def completions(raw_request: Request) -> Response:
        return await generate(raw_request, CompletionRequest, lambda m, r: m.completion.create(r, raw_request))

    @app.post("/tokenize", dependencies=auth, openapi_extra=openapi.request_body(TokenizeRequest),
              responses=openapi.responses(TokenizeResponse, errors=(400, 401, 404, 413, 503)))
    async def tokenize(raw_request: Request) -> JSONResponse:
        req = await parse_body(raw_request, TokenizeRequest)
        model = served(req.model, raw_request, req)
        tokenizer, max_model_len = model.engine.tokenizer, model.engine.max_model_len
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            try:
                messages = [m.to_template_dict() for m in req.messages]
                if any(m.role == "tool" or m.tool_calls for m in req.messages) and \
                        "tools" not in (tokenizer.chat_template or ""):
                    messages = render_messages(messages, None)  # as chat renders a history with tool calls
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except InvalidParameterError as exc:
                raise to_openai_error(exc) from None
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt, add_special_tokens=add)
        strs = [tokenizer.token_bytes(t).decode("utf-8", "replace") for t in ids] if req.return_token_strs else None
        resp = TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(resp.model_dump(mode="json", exclude_none=True))

    @app.post("/detokenize", dependencies=auth, openapi_extra=openapi.request_body(DetokenizeRequest),
              responses=openapi.responses(DetokenizeResponse, errors=(400, 401, 404, 413, 503)))
    async def detokenize(raw_request: Request) -> JSONResponse:
        req = await parse_body(raw_request, DetokenizeRequest)
        tokenizer = served(req.model, raw_request, req).engine.tokenizer
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(req.tokens)).model_dump(mode="json"))

    return app


def card(model: ServedModel) -> ModelCard:
    """The ``/v1/models`` entry of a served model."""
    return ModelCard(id=model.name, root=model.engine.engine.model_path, max_model_len=model.engine.max_model_len)


def _banner(host: str, port: int, model: str, max_model_len: int | str, api_key: bool,
            example_model: str | None = None) -> str:
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    body = shlex.quote(f'{{"model": "{example_model or model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
                       f'"max_tokens": 32}}')
    auth = " -H 'Authorization: Bearer YOUR_API_KEY'" if api_key else ""  # the key given with --api-key
    return (f"leanserve: serving {model} (max_model_len {max_model_len}) on {url}  (OpenAI API under {url}/v1, "
            f"metrics at {url}/metrics; Ctrl-C to stop)\n"
            f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d {body}")


class LeanserveServer(uvicorn.Server):
    """uvicorn's server, printing the URL once listening.

    - SIGTERM (with ``shutdown_timeout`` > 0) drains: the engine refuses new requests (the gate answers 503 +
      Retry-After, ``/health`` 503) while the server keeps listening; the in-flight requests get up to
      ``shutdown_timeout`` seconds to finish, then the rest are aborted (finish_reason "abort") and the server
      stops with status 0.
    - Ctrl-C (SIGINT), a SIGTERM with ``shutdown_timeout`` 0, or any second signal during a drain ends at once:
      the in-flight requests are aborted so the graceful shutdown is quick; exit status 0.
    - An engine thread that died (a failure it could not isolate) stops the server with :attr:`exit_code` 1.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, banner: Callable[[int], str],
                 shutdown_timeout: float = 0.0) -> None:
        super().__init__(config)
        self._engine = engine
        self._banner = banner
        self._loop: asyncio.AbstractEventLoop | None = None
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            print(self._banner(self.servers[0].sockets[0].getsockname()[1]), flush=True)

    def handle_exit(self, sig, frame) -> None:
        loop = self._loop if self._loop is not None and not self._loop.is_closed() else None
        if sig == signal.SIGTERM and not self.draining and not self.should_exit and self.shutdown_timeout > 0 \
                and loop is not None:
            self.draining = True
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would re-raise the signal after shutting down; exit 0 instead
        if loop is not None:
            loop.call_soon_threadsafe(self._engine.begin_shutdown)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine, timeout = self._engine, self.shutdown_timeout
        engine.begin_drain()
        n = engine.num_in_flight
        print(f"leanserve: SIGTERM: draining {n} in-flight request(s), up to {timeout:g} s (new requests get 503; "
              "a second signal ends at once)", flush=True)
        deadline = time.monotonic() + timeout
        while engine.num_in_flight and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        left = engine.num_in_flight
        if left and not self.should_exit:
            print(f"leanserve: shutdown timeout: aborting {left} request(s)", flush=True)
        engine.begin_shutdown()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        dead = self._engine.dead
        if dead is not None and not self.should_exit:
            logger.error("the engine thread failed (%r); stopping the server with exit status 1", dead)
            print(f"leanserve: the engine failed ({dead!r}); exiting with status 1", file=sys.stderr, flush=True)
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)


def app_options(sc: ServerConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`build_app` that ``sc`` sets (limits, stall timeout, context policies, the
    answer cache): one place for the single server and each Ray Serve replica."""
    return {"limits": RequestLimits(max_request_bytes=sc.max_request_bytes), "stall_timeout": sc.engine_stall_timeout,
            "context": ContextSettings(sc.max_prompt_tokens, sc.max_context_tokens, sc.top_k_documents,
                                       sc.history_summary_tokens),
            "answer_cache_bytes": None if sc.answer_cache == "off" else (sc.answer_cache_bytes or 64 << 20),
            "answer_cache_ttl": sc.answer_cache_ttl or 600.0, "answer_cache_semantic": sc.answer_cache == "semantic",
            "answer_cache_similarity": sc.answer_cache_similarity}


def run_server(engine_config: EngineConfig, server_config: ServerConfig, models: list[ModelSpec] | None = None
               ) -> int:
    """Load the engine (or one engine per model of ``models``, each with its own engine thread and KV pool) and
    serve it until Ctrl-C/SIGTERM. Returns the exit status: 0, 2 when the address cannot be bound (checked before
    the model loads), or 1 when an engine thread died.

    Args:
        models: several models (:func:`~leanserve.entrypoints.openai.models_config.model_specs`); None: the one
            model of ``engine_config`` served as ``server_config.served_model_name``. With more than one and
            ``server_config.serialize_model_steps``, their engines step one at a time (:class:`StepLock`).

    Raises:
        InvalidParameterError, ModelLoadError: from loading an engine, two models under one name, or a bad
            ``--api-keys-file``.
    """
    sc = server_config
    logging.basicConfig(level=getattr(logging, sc.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    specs = models or [ModelSpec(engine_config, sc.served_model_name)]
    names = served_names(specs)  # before anything loads: two models under one name fail at once
    routers = router_specs(sc, names)  # before anything loads too
    policies = build_policies(routers)
    defaults = TenantLimits(sc.tenant_max_concurrent, sc.tenant_requests_per_minute, sc.tenant_tokens_per_minute)
    tenants = TenantRegistry.from_config(sc.api_keys, sc.api_keys_file, defaults)  # before the model loads
    if tenants is not None:
        logger.info("tenants: %s", ", ".join(t.name for t in tenants.tenants))
    try:  # before the model loads, so that a taken port or a bad address fails at once
        family = socket.getaddrinfo(sc.host, sc.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((sc.host, sc.port), family=family)
    except (OSError, OverflowError) as e:
        print(f"error: cannot listen on {sc.host}:{sc.port}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    step_lock = StepLock() if len(specs) > 1 and sc.serialize_model_steps else None
    llm_engines = [LLMEngine(s.engine) for s in specs]  # all loaded before any engine thread steps
    for name, e in zip(names, llm_engines, strict=True):
        logger.info("%s: %s", name, e.describe())
    limit = min(e.max_model_len for e in llm_engines)
    if sc.history_summary_tokens and sc.history_summary_tokens >= limit:  # as the request field
        sock.close()
        raise InvalidParameterError("history_summary_tokens", f"history_summary_tokens must be less than the "
                                    f"model's context length ({limit}), got {sc.history_summary_tokens}")
    engines = {name: AsyncEngine(e, max_waiting=sc.max_waiting, request_timeout=sc.request_timeout,
                                 step_lock=step_lock) for name, e in zip(names, llm_engines, strict=True)}
    app = build_app(engines, tenants=tenants, routers=routers, router_policies=policies, **app_options(sc))
    served = app.state.models
    # asyncio + h11 named, not uvicorn's "auto": the [ray] extra installs uvloop and httptools, which "auto" would
    # pick up, so one server would behave differently with and without the extra
    config = uvicorn.Config(app, host=sc.host, port=sc.port, log_level=sc.log_level, timeout_graceful_shutdown=10,
                            lifespan="on", loop="asyncio", http="h11")
    lens = sorted({e.max_model_len for e in llm_engines})
    server = LeanserveServer(config, served if len(served) > 1 else served.default.engine,
                             lambda port: _banner(sc.host, port, ", ".join(names), lens[-1] if len(lens) == 1 else
                                                  "/".join(map(str, lens)), tenants is not None, names[0]),
                             shutdown_timeout=sc.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        served.shutdown()
    print("leanserve: server stopped", flush=True)
    return server.exit_code
