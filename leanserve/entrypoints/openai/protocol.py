"""Pydantic models of the OpenAI-compatible API (requests and responses), plus vLLM's extension fields.

Requests validate strictly (no "5" for 5, no true for 1); unknown fields are ignored and logged at debug level.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)


class OpenAIBaseModel(BaseModel):
    """Base of request models: strict types, unknown fields ignored (and logged at debug level)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [k for k in data if k not in known]
            if unknown:
                logger.debug("%s: ignoring unknown fields %s", cls.__name__, unknown)
        return data


class ResponseModel(BaseModel):
    """Base of response models (built by the server, so not strict)."""


# ----------------------------------------------------------------------------------------------------- requests
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    """A tool call in an assistant message of the history (or of a response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None  # None only for an assistant message
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _check_content(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        content = data.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"content part of type {kind!r} is not supported: only text parts are")
        if data.get("role") != "assistant" and (content is None or content == []):
            raise ValueError(f"a {data.get('role')} message needs content (a string or text parts)")
        if data.get("tool_calls") is not None and data.get("role") != "assistant":
            raise ValueError("only an assistant message may have tool_calls")
        if data.get("role") == "tool" and not isinstance(data.get("tool_call_id"), str):
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return data

    def to_template_dict(self) -> dict[str, Any]:
        """The dict the chat template sees: role (developer as system) and content as one string."""
        if isinstance(self.content, list):
            content = "".join(p.text for p in self.content)
        else:
            content = self.content or ""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF / xgrammar syntax) with a root rule
    json_object: bool | None = None


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extensions)."""

    model: str | None = None  # None: the served model
    n: int | None = 1
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    speculative: bool | None = True  # leanserve: False turns the server's speculative decoding off for this request
    priority: int | None = 0
    # vLLM's structured outputs (one constraint at most, also counting chat's response_format)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # context optimization (leanserve.context; reported in usage.leanserve)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last k prompt tokens; -1 = the model's limit
    cache: bool | None = True  # leanserve: false bypasses the server's answer cache (--answer-cache)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """``null`` for a field with a non-null default means the default (as OpenAI's API treats it)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: fields[k].default if v is None and k in fields and fields[k].default is not None else v
                    for k, v in data.items()}
        return data


class Document(OpenAIBaseModel):
    """A retrieved passage sent apart from the question (``documents``)."""

    id: str = Field(min_length=1)
    text: str

    @field_validator("text")
    @classmethod
    def _has_text(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("empty_document", "a document's text must not be empty or whitespace only")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # context optimization (leanserve.context): history under a budget, RAG passages
    max_prompt_tokens: int | None = Field(None, ge=1)  # drop the oldest turns to fit (system, last turn stay)
    keep_last_turns: int | None = Field(None, ge=1)  # keep the latest user turn and the N - 1 before it
    # replace the turns dropped by max_prompt_tokens / keep_last_turns with a summary of at most N tokens written
    # by the served model (cached per dropped prefix); 0 = off; None: the server's --history-summary-tokens
    history_summary_tokens: int | None = Field(None, ge=0)
    documents: list[Document] | None = None  # passages; the query is the last user message
    max_context_tokens: int | None = Field(None, ge=1)  # token budget of the passages kept
    top_k_documents: int | None = Field(None, ge=1)  # most passages kept
    reorder_documents: bool | None = True  # the most relevant passages at both ends ("lost in the middle")
    max_tokens: int | None = None  # None: until the model stops or the context is full
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = None  # vLLM: logprobs of the prompt tokens with this many alternatives (0..20)


PASSAGE_FIELDS = ("documents", "max_context_tokens", "top_k_documents", "reorder_documents")
CHAT_ONLY_FIELDS = PASSAGE_FIELDS + ("max_prompt_tokens", "keep_last_turns", "history_summary_tokens")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM: logprobs of the prompt tokens with this many alternatives (0..20)
    # the chat request's context fields (passages, history): refused here with a 400 naming the field, not
    # ignored: a raw prompt has no messages to trim and no chat template to place passages in
    documents: list[Document] | None = None
    max_context_tokens: int | None = None
    top_k_documents: int | None = None
    max_prompt_tokens: int | None = None
    keep_last_turns: int | None = None
    history_summary_tokens: int | None = None
    reorder_documents: bool | None = None

    @field_validator(*CHAT_ONLY_FIELDS, mode="before")
    @classmethod
    def _chat_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            hint = ("put the passages in the prompt" if info.field_name in PASSAGE_FIELDS else
                    "cut the prompt with truncate_prompt_tokens")
            raise PydanticCustomError("chat_only", "{field} is only supported on /v1/chat/completions (it needs "
                                      "messages); on /v1/completions {hint}",
                                      {"field": info.field_name, "hint": hint})
        return value


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------------- responses
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class DuplicateDocument(ResponseModel):
    id: str
    duplicate_of: str


class HistorySummaryUsage(ResponseModel):
    """The summary of the dropped turns (``history_summary_tokens``)."""

    # computed: by an internal request of this one; reused: from the summary cache (or a concurrent request's
    # computation); skipped: it would not fit max_prompt_tokens; failed: its request failed (plain dropping)
    status: Literal["computed", "reused", "skipped", "failed"]
    replaces: list[int]  # indexes into the request's messages that the summary stands for
    role: str = "system"  # the summary's message, right after the leading system/developer messages
    prompt_tokens: int = 0  # of the internal summary request this request ran (0 when reused)
    completion_tokens: int = 0
    reason: str | None = None  # why it was skipped or failed


class RouteUsage(ResponseModel):
    """Which router model decided what (``usage.leanserve.route``; ``--model-router``, ``--model-routers-file``)."""

    router: str  # the virtual model the request named ("auto" or a named router)
    policy: str  # rules, learned or cascade
    model: str  # the served model that answered (also the response's model)
    reason: str  # why, in words
    score: float | None = None  # learned: the hardness score; cascade: the cheap answer's mean token logprob
    escalated_from: str | None = None  # cascade: the cheap model whose answer was judged too unsure
    cheap_completion_tokens: int | None = None  # cascade, escalated: tokens the cheap answer had generated
    # cascade, escalated with history_summary_tokens: the cheap model's own summary of the dropped turns (each
    # model summarizes with itself; the strong model's is usage.leanserve.history_summary)
    cheap_history_summary: HistorySummaryUsage | None = None


class ContextUsage(ResponseModel):
    """leanserve's report of the context policies and the answer cache (``usage.leanserve``); present when a
    policy or the answer cache applied to the request."""

    prompt_tokens_sent: int  # prompt tokens as the client sent them (rendered), before any policy
    prompt_tokens_computed: int  # computed now: prompt_tokens - cached_tokens - the answer-cache hits' prompts
    truncated_tokens: int = 0  # cut by truncate_prompt_tokens (from the start of the prompt)
    dropped_messages: list[int] | None = None  # indexes into the request's messages, by max_prompt_tokens / turns
    documents_used: list[str] | None = None  # passage ids, in prompt order
    documents_dropped: list[str] | None = None  # left out by top_k_documents / max_context_tokens, by rank
    documents_duplicates: list[DuplicateDocument] | None = None  # exact or near duplicates removed
    history_summary: HistorySummaryUsage | None = None  # the dropped turns' summary (history_summary_tokens)
    cache: Literal["hit", "miss", "bypass"] | None = None  # the answer cache's verdict (None: cache off)
    route: RouteUsage | None = None  # the router's decision, for a request sent to a router model


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    leanserve: ContextUsage | None = None  # context policies and answer cache (omitted when none applied)

    @model_serializer(mode="wrap")
    def _omit_absent_report(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("leanserve", 0) is None:
            del data["leanserve"]
        return data


class Timings(ResponseModel):
    """Per-request timings, in the spirit of llama.cpp's ``timings`` (milliseconds; None if not reached)."""

    prompt_n: int
    cached_n: int
    predicted_n: int
    queue_ms: float | None = None
    prompt_ms: float | None = None  # prefill: first scheduling to first token
    ttft_ms: float | None = None  # arrival to first token, queueing included
    decode_ms: float | None = None  # first to last token
    predicted_per_token_ms: float | None = None
    predicted_per_second: float | None = None  # decode speed of one sequence, tokens after the first
    e2e_ms: float | None = None
    draft_n: int = 0  # speculative decoding: draft tokens verified
    draft_n_accepted: int = 0  # of which accepted (llama.cpp's names)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "leanserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's ``Logprob``: one token's entry in ``prompt_logprobs`` (keys of the dict are token ids)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token; None for the first


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken] | None = None


class ResponseFunctionCall(ResponseModel):
    name: str
    arguments: str


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    timings: Timings | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, when the request asked


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class CompletionLogprobs(ResponseModel):
    """The legacy completions format: parallel lists per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, when computed (prompt_logprobs, echo + logprobs)


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    timings: Timings | None = None


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
