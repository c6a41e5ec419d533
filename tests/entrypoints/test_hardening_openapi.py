"""The OpenAPI document declares every endpoint's request and response bodies (pydantic models), streaming as
text/event-stream; and a lean schemathesis run over the whole API on the shared server finds no server error and
no response off its schema."""

from __future__ import annotations

import asyncio

from leanserve.engine.async_engine import AsyncEngine
from leanserve.entrypoints.openai.api_server import build_app
from leanserve.entrypoints.openai.openapi import REQUEST_MODELS, STREAM_MODELS
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

import httpx
import pytest
from test_async_engine import FakeEngine

POST_ROUTES = {"/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
               "/v1/completions": (CompletionRequest, CompletionResponse),
               "/tokenize": (TokenizeRequest, TokenizeResponse),
               "/detokenize": (DetokenizeRequest, DetokenizeResponse)}
STREAMING = {"/v1/chat/completions", "/v1/completions"}


@pytest.fixture(scope="module")
def schema():
    engine = AsyncEngine(FakeEngine())
    app = build_app(engine, "served-name")
    yield app.openapi()
    engine.shutdown()


def ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def test_every_post_route_declares_its_request_and_response_models(schema):
    components = schema["components"]["schemas"]
    for path, (request, response) in POST_ROUTES.items():
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["required"] is True
        assert op["requestBody"]["content"] == {"application/json": {"schema": ref(request)}}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == ref(response)
        assert ("text/event-stream" in ok) == (path in STREAMING)
        for status in ("400", "401", "413", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in op["responses"]  # validation errors are OpenAI 400s, not FastAPI's 422
        # the component is the model's own JSON schema: the same fields, the same required ones
        comp = components[request.__name__]
        assert set(comp["properties"]) == set(request.model_fields)
        assert set(comp.get("required", [])) == {n for n, f in request.model_fields.items() if f.is_required()}
    for model in (*REQUEST_MODELS, *STREAM_MODELS, ModelList):
        assert model.__name__ in components
    assert schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == \
        ref(ModelList)
    assert set(schema["paths"]) == {*POST_ROUTES, "/v1/models", "/health", "/metrics"}


def test_schema_documents_the_checks(schema):
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["model"]["anyOf"][0] == {"type": "string", "enum": ["served-name"]}
    assert props["top_p"]["exclusiveMinimum"] == 0 and props["top_p"]["maximum"] == 1
    assert props["n"]["maximum"] == 128 and props["top_logprobs"]["maximum"] == 20
    assert props["stop"]["anyOf"][1]["maxItems"] == 32 and props["messages"]["maxItems"] == 4096
    assert props["tools"]["maxItems"] == 128 and "tool_choice" in props and "response_format" in props
    assert props["messages"]["minItems"] == 1
    message = schema["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["minimum"] == 0 and completion["max_tokens"]["default"] == 16


def test_docs_page_and_schema_are_served():
    engine = AsyncEngine(FakeEngine())
    app = build_app(engine, "served-name", api_key="k")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/openapi.json"), await c.get("/docs")

    spec, docs = asyncio.run(main())
    engine.shutdown()
    assert spec.status_code == 200 and spec.json()["paths"]["/v1/completions"]["post"]["requestBody"]
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_schemathesis_finds_no_server_error_and_no_response_off_its_schema(server):
    """The lean CI run: every operation, valid and invalid requests, bounded in examples and time (the long run
    is `python -m benchmarks.fuzz_api`, see the README)."""
    from benchmarks.fuzz_api import fuzz

    report = fuzz(server.url, server.headers, max_examples=15, time_budget=300, negative=True, seed=0)
    assert not report.failures, "\n\n".join(report.failures[:3])
    assert not report.out_of_time
    ops = {label.rsplit(" ", 1)[0] for label, n in report.examples.items() if n}
    assert ops == {"GET /health", "HEAD /health", "GET /metrics", "HEAD /metrics", "GET /v1/models",
                   "POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize"}
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert report.examples[f"POST {path} positive"] == 15 and report.examples[f"POST {path} negative"] == 15
    assert report.statuses[200] >= 20 and report.statuses[400] >= 20  # valid ones served, invalid ones refused
    assert not any(status >= 500 for status in report.statuses)
