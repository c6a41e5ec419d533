"""One streaming request to an OpenAI-compatible server (/v1/chat/completions or /v1/completions) with httpx,
timed on the client: time to first token, every inter-chunk gap, end-to-end latency, usage token counts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leanserve.bench.workloads import BenchRequest

import httpx

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestResult:
    """What the client saw of one request. Times are in seconds (``start`` from the benchmark's start).

    Attributes:
        success: the stream ended normally and produced output text.
        prompt_tokens: prompt tokens (the server's usage, else the workload's count).
        output_tokens: generated tokens (the server's usage, else the tokenizer's count of the text).
        ttft: time to the first chunk with output text.
        itl: gaps between consecutive chunks with output text (one per chunk after the first).
        latency: end-to-end time, from sending to the end of the stream.
        start: when the request was sent, from the benchmark's start.
        cached_tokens: prompt tokens the server served from its prefix cache (usage), when it says.
        usage_reported: whether the token counts came from the server's usage.
        error: why it failed ("" on success).
    """

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    cached_tokens: int | None = None
    usage_reported: bool = False
    generated_text: str = ""
    error: str = ""
    answer_cache: str | None = None  # leanserve's usage.leanserve.cache: "hit", "miss" or "bypass", when given


def build_payload(req: BenchRequest, model: str, endpoint: str) -> dict[str, Any]:
    """The JSON body of a streaming request: greedy, exactly ``req.max_tokens`` tokens (``ignore_eos``), usage in
    the stream; then ``req.extra``'s fields.

    Raises:
        ValueError: ``endpoint`` is neither ``chat`` nor ``completions``.
    """
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = req.messages
    elif endpoint == "completions":
        body["prompt"] = req.prompt
    else:
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    body.update(req.extra)
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, req: BenchRequest, model: str, endpoint: str = "chat",
                       bench_start: float = 0.0, count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """Send ``req`` as a streaming request on ``client`` (its base URL and headers set) and time it.

    Args:
        endpoint: ``chat`` or ``completions``.
        bench_start: ``time.perf_counter()`` at the benchmark's start (for :attr:`RequestResult.start`).
        count_tokens: counts the output text's tokens when the server reports no usage (None: one per chunk).

    Never raises for HTTP or stream errors: they are returned in :attr:`RequestResult.error`.
    """
    result = RequestResult(prompt_tokens=req.prompt_len)
    payload = build_payload(req, model, endpoint)
    start = time.perf_counter()
    result.start = start - bench_start
    last = start
    texts: list[str] = []
    try:
        async with client.stream("POST", ENDPOINTS[endpoint], json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                result.latency = time.perf_counter() - start
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    break
                now = time.perf_counter()
                text = _chunk_text(chunk, endpoint)
                if text:
                    if not texts:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    texts.append(text)
                usage = chunk.get("usage")
                if usage:
                    result.usage_reported = True
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = int(usage.get("prompt_tokens") or req.prompt_len)
                    result.answer_cache = (usage.get("leanserve") or {}).get("cache")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(texts)
    if not result.usage_reported:
        result.output_tokens = count_tokens(result.generated_text) if count_tokens else len(texts)
    if not result.error and not texts:
        result.error = "no output text in the stream"
    result.success = not result.error
    return result
