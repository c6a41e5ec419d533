"""The OpenAPI document (``/openapi.json``, ``/docs``): request bodies, responses and their schemas.

The routes read their bodies by hand (:func:`~.serving_common.parse_body`: the OpenAI error envelope, the size,
depth and list limits, exact messages), so FastAPI sees no body parameter; each POST route instead declares its
pydantic request model here (``openapi_extra``), and :func:`install` adds the models' JSON schemas (validation
mode) to ``components.schemas``. What the schema says is what the handlers accept: the ``model`` field is the
served name (any other is a 404), the ranges that the sampling parameters check are given as ``minimum`` /
``maximum``, token ids as ``[0, vocab_size)``, the list limits as ``maxItems``, the unsupported fields
(``logit_bias``, ``suffix``) as empty-only, and the rules between fields
(``stream_options`` needs ``stream``, ``top_logprobs`` needs ``logprobs``, no ``echo`` with ``logprobs``, content
for every message but an assistant's, exactly one of ``prompt`` and ``messages`` for ``/tokenize``) as
``anyOf`` / ``oneOf``. All of it is documentation: the checks and their messages stay in the handlers and
``SamplingParams``. What it cannot say: ``min_tokens`` <= ``max_tokens``, and prompt + ``max_tokens`` within the
context. Streaming responses are ``text/event-stream``; their events' JSON are the ``*Chunk`` /
``CompletionStreamResponse`` schemas.
"""

from __future__ import annotations

from typing import Any

from leanserve.entrypoints.openai.limits import RequestLimits
from leanserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionStreamResponse,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from leanserve.sampling_params import MAX_LOGPROBS

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                               DetokenizeRequest)
STREAM_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, CompletionStreamResponse)
_REF = "#/components/schemas/{model}"

# Documented ranges of the fields SamplingParams and the handlers check (property -> JSON Schema keywords).
_RANGES: dict[str, dict[str, Any]] = {
    "n": {"minimum": 1, "maximum": 128},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "seed": {"minimum": -(2**63), "maximum": 2**64 - 1},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a POST route whose body is ``model`` (JSON)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


_ERRORS = {
    400: "invalid request: bad JSON, a bad field or value, nesting or a list over its limit",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request ran past the server's --request-timeout",
    413: "request body over --max-request-bytes",
    429: "a tenant limit (concurrent requests, requests or tokens per minute); see Retry-After",
    500: "the engine step running this request failed",
    503: "overloaded, shutting down, or the engine is not running; see Retry-After",
}


def responses(ok: type[BaseModel], stream: type[BaseModel] | None = None,
              errors: tuple[int, ...] = (400, 401, 413, 429, 503)) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` of a route answering ``ok`` as JSON (or, with ``stream``, SSE events of that model
    when the request sets ``"stream": true``) and the given error statuses in the OpenAI envelope."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": ok, "description": "the result"}}
    if stream is not None:
        out[200]["description"] = ("the result; with \"stream\": true a text/event-stream of `data: <JSON>` events "
                                   f"(each a {stream.__name__}) ending with `data: [DONE]`")
        out[200]["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "description": f"one server-sent event: `data: <{stream.__name__} JSON>` and a blank line; an error "
            "after the stream started comes as one `data: <ErrorResponse JSON>` event; the last event is "
            "`data: [DONE]`",
            "properties": {"event": {"type": "string"}, "data": {"anyOf": [
                {"type": "string", "const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": _REF.format(model=stream.__name__)},
                                             {"$ref": _REF.format(model=ErrorResponse.__name__)}]}}]}}}}}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERRORS[status]}
    return out


def _ids(vocab_size: int | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size:
        item["maximum"] = vocab_size - 1
    return item


def _nullable(*schemas: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [*schemas, {"type": "null"}]}


def _field_rules(components: dict[str, Any], limits: RequestLimits, vocab_size: int | None) -> None:
    """The rules the handlers check beyond each field's type (see the module doc)."""
    ids = _ids(vocab_size)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[name]["properties"]
        stop_strings = {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": limits.max_stop}
        props["stop"] = {**_nullable({"type": "string", "minLength": 1}, stop_strings), "default": None,
                         "title": "Stop"}
        props["stop_token_ids"] = {**_nullable({"type": "array", "items": ids, "maxItems": limits.max_stop_token_ids}),
                                   "default": None, "title": "Stop Token Ids"}
        props["logit_bias"] = {**_nullable({"type": "object", "maxProperties": 0}), "default": None,
                               "title": "Logit Bias", "description": "not supported: null or {} only"}
        rules = [{"anyOf": [{"properties": {"stream": {"const": True}}, "required": ["stream"]},
                            {"properties": {"stream_options": {"type": "null"}}}]}]
        components[name]["allOf"] = rules
    chat = components["ChatCompletionRequest"]
    chat["allOf"].append({"anyOf": [{"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                                    {"properties": {"top_logprobs": {"type": "null"}}}]})
    completion = components["CompletionRequest"]
    completion["properties"]["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": limits.max_prompts},
        {"type": "array", "items": ids, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": ids, "minItems": 1}, "minItems": 1,
         "maxItems": limits.max_prompts}],
        "title": "Prompt", "description": "a text, texts, token ids, or lists of token ids (not empty)"}
    completion["properties"]["suffix"] = {**_nullable({"type": "string", "maxLength": 0}), "default": None,
                                          "title": "Suffix", "description": "not supported: null or \"\" only"}
    completion["allOf"].append({"anyOf": [{"properties": {"echo": {"const": False}}},
                                          {"properties": {"logprobs": {"type": "null"}}}]})
    components["DetokenizeRequest"]["properties"]["tokens"]["items"] = ids
    tokenize = components["TokenizeRequest"]
    tokenize["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]
    # every message but an assistant's has content: a string or at least one text part
    components["ChatMessage"]["anyOf"] = [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/TextContentPart"}}]}}}]
    # a tool message answers a call (tool_call_id); only an assistant message makes calls
    components["ChatMessage"]["allOf"] = [
        {"anyOf": [{"properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}}},
                   {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}]},
        {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                   {"properties": {"tool_calls": {"type": "null"}}}]}]


def _patch_request_schema(schema: dict[str, Any], served_model_name: str | list[str], limits: RequestLimits) -> None:
    props = schema.get("properties", {})
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if "model" in props:
        props["model"] = {"anyOf": [{"type": "string", "enum": names}, {"type": "null"}],
                          "default": None, "title": "Model",
                          "description": "the served model's name (any other gets 404); null: the served model"}
    for name, extra in _RANGES.items():
        if name in props:
            props[name].update(extra)
    max_items = {"messages": limits.max_messages, "tokens": limits.max_token_ids, "tools": limits.max_tools,
                 "documents": limits.max_documents}
    for name, n in max_items.items():
        if name in props:
            props[name]["maxItems"] = n


def install(app: FastAPI, served_model_name: str | list[str], limits: RequestLimits,
            vocab_size: int | None = None) -> None:
    """Make ``app.openapi()`` include the request models (and the stream event models) as component schemas;
    ``served_model_name``: the served name(s) ``model`` may take; ``vocab_size`` bounds the documented token ids."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        models = [(m, "validation") for m in REQUEST_MODELS] + [(m, "serialization") for m in STREAM_MODELS]
        _, defs = models_json_schema(models, ref_template=_REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, s in defs.get("$defs", {}).items():
            components.setdefault(name, s)
        for model in REQUEST_MODELS:
            _patch_request_schema(components[model.__name__], served_model_name, limits)
        _field_rules(components, limits, vocab_size)
        components[CompletionRequest.__name__]["properties"]["max_tokens"]["minimum"] = 0  # 0: echo only
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
