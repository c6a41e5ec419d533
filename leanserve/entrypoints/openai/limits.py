"""Bounds on what one request may send, checked before any work is done for it.

- The body: at most ``max_request_bytes`` (``--max-request-bytes``): 413, checked on ``Content-Length`` before a
  byte is read, and while reading a body sent without one (:class:`BodyLimitExceeded` from the counting receive).
- The JSON: nesting at most ``max_json_depth`` levels (a deeper body got a ``RecursionError`` 500 before), no
  integer of more than 4300 digits (Python's limit: a 400, not a 500), no lone UTF-16 surrogate escape
  (``"\\ud800"``: no tokenizer can encode it). ``NaN`` and ``Infinity`` parse, as before, and the sampling
  parameters refuse them (400 naming the field).
- Lists: stop strings, stop token ids, messages, prompts in a batch, tools, token ids to detokenize; each 400
  names the field and its limit.

Every refusal is a :class:`LimitExceeded` (status, message, param, code) that the server answers in the OpenAI
error envelope.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (the body size is ``--max-request-bytes``; the others are fixed defaults)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_depth: int = 64  # nesting levels of arrays and objects; {"messages": [{...}]} is 3
    max_messages: int = 4096  # chat messages (also /tokenize's)
    max_prompts: int = 256  # prompts in one completions batch
    max_stop: int = 32  # stop strings
    max_stop_token_ids: int = 256
    max_tools: int = 128  # OpenAI's own limit
    max_token_ids: int = 1 << 17  # token ids of one /detokenize request


class LimitExceeded(Exception):
    """A request outside the bounds: answered with ``status`` and the OpenAI envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class BodyLimitExceeded(LimitExceeded):
    """The body grew past ``max_request_bytes`` while it was read."""

    def __init__(self, limit: int, received: int | None = None) -> None:
        got = f" (Content-Length {received})" if received is not None else ""
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes{got}",
                         None, "request_too_large")


def loads(body: bytes, limits: RequestLimits) -> Any:
    """Parse a JSON body within the limits.

    Raises:
        json.JSONDecodeError, UnicodeDecodeError, ValueError: not JSON (the caller's "not valid JSON" 400).
        LimitExceeded: nested too deep, or a lone surrogate.
    """
    # strict UTF-8 first: json.loads(bytes) would also take UTF-16/32 and UTF-8-encoded surrogates
    # ("surrogatepass"), which no later step can encode
    text = body.decode("utf-8") if isinstance(body, bytes | bytearray) else body
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep(limits) from None
    # Arrays and objects can only nest as deep as there are brackets: a cheap bound before walking.
    if body.count(b"[") + body.count(b"{") > limits.max_json_depth:
        check_depth(data, limits)
    if b"\\ud" in body or b"\\uD" in body:
        check_strings(data)
    return data


def _too_deep(limits: RequestLimits) -> LimitExceeded:
    return LimitExceeded(400, f"the JSON body is nested deeper than the limit of {limits.max_json_depth} levels",
                         None, "json_too_deep")


def check_depth(data: Any, limits: RequestLimits) -> None:
    """Raise LimitExceeded when arrays/objects nest deeper than ``limits.max_json_depth`` (iterative walk)."""
    limit = limits.max_json_depth
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise _too_deep(limits)
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))


def check_strings(data: Any) -> None:
    """Raise LimitExceeded (400) for a string holding a lone UTF-16 surrogate (keys included)."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise LimitExceeded(400, "the body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                    "escape), which is not text", None, "invalid_unicode") from None


def _count(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def check_lists(data: dict[str, Any], kind: str, limits: RequestLimits) -> None:
    """Raise LimitExceeded (400) when a list field of a ``kind`` request ("chat", "completion", "tokenize",
    "detokenize") is longer than its limit. Runs before the fields are validated (types are checked later)."""
    bounds: list[tuple[str, int, str]] = []
    if kind in ("chat", "completion"):
        bounds += [("stop", limits.max_stop, "stop strings"),
                   ("stop_token_ids", limits.max_stop_token_ids, "stop token ids")]
    if kind in ("chat", "tokenize"):
        bounds.append(("messages", limits.max_messages, "messages"))
    if kind == "chat":
        bounds.append(("tools", limits.max_tools, "tools"))
    if kind == "detokenize":
        bounds.append(("tokens", limits.max_token_ids, "token ids"))
    for name, limit, what in bounds:
        n = _count(data.get(name))
        if n is not None and n > limit:
            raise LimitExceeded(400, f"{name}: at most {limit} {what} are allowed, got {n}", name, "too_many_items")
    if kind == "completion":
        prompt = data.get("prompt")
        # a batch is a list of strings or of token-id lists; a flat list of ints is one prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > limits.max_prompts:
            raise LimitExceeded(400, f"prompt: at most {limits.max_prompts} prompts are allowed in one request, got "
                                f"{len(prompt)}", "prompt", "too_many_items")
