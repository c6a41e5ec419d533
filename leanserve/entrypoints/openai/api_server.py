"""The OpenAI-compatible HTTP server: FastAPI app factory (:func:`build_app`) and runner (:func:`run_server`).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics``. Every error is an OpenAI error envelope
``{"error": {"message", "type", "param", "code"}}`` (never HTML); with an API key, every endpoint but
``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from leanserve.config import EngineConfig, ServerConfig
from leanserve.engine.async_engine import AsyncEngine
from leanserve.engine.llm_engine import LLMEngine
from leanserve.entrypoints.openai.metrics import ServerMetrics
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from leanserve.entrypoints.openai.serving_chat import OpenAIServingChat
from leanserve.entrypoints.openai.serving_common import (
    ARRIVAL_KEY,
    OpenAIError,
    bad_request,
    check_model,
    parse_body,
    to_openai_error,
)
from leanserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from leanserve.errors import InvalidParameterError

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
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


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``served_model_name``.

    The app has its own metrics registry (registered as an observer of ``engine``); its lifespan shuts the
    engine down when the server stops.
    """
    metrics = ServerMetrics(served_model_name, engine.stats, engine.max_model_len)
    engine.add_observer(metrics)
    chat = OpenAIServingChat(engine, served_model_name)
    completion = OpenAIServingCompletion(engine, served_model_name)
    tokenizer = engine.tokenizer
    key = api_key.encode() if api_key else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="leanserve", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(ArrivalTimeMiddleware)

    async def require_api_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key):
            raise OpenAIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                              "invalid_request_error", None, "invalid_api_key")

    auth = [Depends(require_api_key)]

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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(to_openai_error(exc))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error_response(OpenAIError(503, "the engine is not running", "server_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> JSONResponse:
        card = ModelCard(id=served_model_name, root=engine.engine.model_path, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(raw_request: Request) -> Response:
        return await chat.create(await parse_body(raw_request, ChatCompletionRequest), raw_request)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(raw_request: Request) -> Response:
        return await completion.create(await parse_body(raw_request, CompletionRequest), raw_request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(raw_request: Request) -> JSONResponse:
        req = await parse_body(raw_request, TokenizeRequest)
        check_model(req.model, served_model_name)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            try:
                text = tokenizer.apply_chat_template([m.to_template_dict() for m in req.messages],
                                                     add_generation_prompt=req.add_generation_prompt)
            except InvalidParameterError as exc:
                raise to_openai_error(exc) from None
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt, add_special_tokens=add)
        strs = [tokenizer.token_bytes(t).decode("utf-8", "replace") for t in ids] if req.return_token_strs else None
        resp = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(resp.model_dump(mode="json", exclude_none=True))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(raw_request: Request) -> JSONResponse:
        req = await parse_body(raw_request, DetokenizeRequest)
        check_model(req.model, served_model_name)
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(req.tokens)).model_dump(mode="json"))

    return app


def default_served_model_name(model_path: str) -> str:
    """The file or folder name of the model, without ``.gguf``."""
    name = os.path.basename(os.path.normpath(model_path))
    return name[:-5] if name.lower().endswith(".gguf") else name


def _banner(host: str, port: int, model: str, max_model_len: int, api_key: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    body = shlex.quote(f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
                       f'"max_tokens": 32}}')
    auth = " -H 'Authorization: Bearer YOUR_API_KEY'" if api_key else ""  # the key given with --api-key
    return (f"leanserve: serving {model} (max_model_len {max_model_len}) on {url}  (OpenAI API under {url}/v1, "
            f"metrics at {url}/metrics; Ctrl-C to stop)\n"
            f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d {body}")


class LeanserveServer(uvicorn.Server):
    """uvicorn's server, printing the URL once listening; on Ctrl-C/SIGTERM it aborts the in-flight requests
    (they end with finish_reason "abort") so the graceful shutdown is quick, then exits with status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, banner: Callable[[int], str]) -> None:
        super().__init__(config)
        self._engine = engine
        self._banner = banner
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            print(self._banner(self.servers[0].sockets[0].getsockname()[1]), flush=True)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would re-raise the signal after shutting down; exit 0 instead
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._engine.begin_shutdown)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the engine and serve it until Ctrl-C/SIGTERM. Returns the exit status: 0, or 2 when the address
    cannot be bound (checked before the model loads).

    Raises:
        InvalidParameterError, ModelLoadError: from loading the engine.
    """
    sc = server_config
    logging.basicConfig(level=getattr(logging, sc.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    try:  # before the model loads, so that a taken port or a bad address fails at once
        family = socket.getaddrinfo(sc.host, sc.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((sc.host, sc.port), family=family)
    except (OSError, OverflowError) as e:
        print(f"error: cannot listen on {sc.host}:{sc.port}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    llm_engine = LLMEngine(engine_config)
    engine = AsyncEngine(llm_engine, max_waiting=sc.max_waiting)
    name = sc.served_model_name or default_served_model_name(llm_engine.model_path)
    app = build_app(engine, name, sc.api_key)
    config = uvicorn.Config(app, host=sc.host, port=sc.port, log_level=sc.log_level, timeout_graceful_shutdown=10,
                            lifespan="on")
    server = LeanserveServer(config, engine,
                             lambda port: _banner(sc.host, port, name, llm_engine.max_model_len, sc.api_key))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    print("leanserve: server stopped", flush=True)
    return 0
