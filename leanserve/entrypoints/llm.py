"""The offline Python API, in the style of vLLM's ``LLM`` class."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from leanserve.config import EngineConfig
from leanserve.context.chat import PreparedChat, prepare_chat
from leanserve.context.summary import SummaryCache, summary_key, summary_prompt
from leanserve.engine.llm_engine import LLMEngine
from leanserve.errors import InvalidParameterError, LeanserveError
from leanserve.loader import LoadedModel
from leanserve.outputs import RequestOutput
from leanserve.sampling_params import SamplingParams
from leanserve.structured.tool_template import ToolTemplate, has_tool_turns

from tqdm.auto import tqdm

PromptType = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}
Message = dict[str, Any]


class LLM:
    """Generate text for batches of prompts with one model; all prompts of a call run as one continuous batch.

    Args:
        model: GGUF file or Hugging Face folder; None = the default SmolLM2-135M-Instruct.
        loaded: reuse an already loaded model (skips loading; ``model`` is then ignored).
        device: torch device; default CUDA when available, else CPU.
        **engine_kwargs: the fields of :class:`leanserve.config.EngineConfig` (``dtype``, ``block_size``,
            ``kv_cache_memory``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
            ``enable_prefix_caching``, ``quantization``, ``kv_cache_dtype``, ...), with its defaults.

    Raises:
        TypeError: an unknown keyword. InvalidParameterError: a bad engine option. ModelLoadError: the model
            cannot be loaded.

    Example:
        >>> llm = LLM()
        >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, device: str | None = None,
                 **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), loaded=loaded, device=device)
        self._ids = itertools.count()
        self.last_chat_context: list[PreparedChat] = []
        self._summaries = SummaryCache()

    def get_tokenizer(self):
        """The model's :class:`leanserve.tokenizer.Tokenizer`."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (no chat template). Returns outputs in prompt order.

        Raises:
            InvalidParameterError: bad prompt or parameter (nothing runs); ContextLengthExceededError,
            KVCapacityError: a prompt too long for the context or the KV pool.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise InvalidParameterError("prompt", f"prompts must be a string, a dict or a list of them, got "
                                        f"{type(prompts).__name__}")
        return self._run([self._prompt_of(p) for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *,
             documents: Sequence[dict[str, str]] | None = None, max_context_tokens: int | None = None,
             top_k_documents: int | None = None, reorder_documents: bool = True,
             max_prompt_tokens: int | None = None, keep_last_turns: int | None = None,
             history_summary_tokens: int | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them, applying the
        model's chat template.

        The context options are the server's (``leanserve.context.prepare_chat``): ``documents`` (``[{"id",
        "text"}]``, de-duplicated, ranked by BM25 against the last user message, kept under
        ``max_context_tokens`` / ``top_k_documents``, reordered unless ``reorder_documents`` is False), then
        ``max_prompt_tokens`` / ``keep_last_turns`` (the oldest turns dropped; system messages and the latest user
        turn stay), with ``history_summary_tokens=N`` the dropped turns replaced by a summary of at most N tokens
        that this model writes (greedy; once per dropped prefix, then reused from an LRU on this object);
        ``truncate_prompt_tokens`` is a field of ``SamplingParams``. What they did, per conversation, is in
        :attr:`last_chat_context` (:class:`~leanserve.context.PreparedChat`: dropped message indexes, passage ids
        used / dropped / duplicates, prompt tokens as sent, ``summary_status`` (computed / reused / skipped /
        failed, as the server's ``usage.leanserve.history_summary``) / ``summary_source``).

        Raises:
            InvalidParameterError: a bad option or conversation; ContextLengthExceededError: a conversation that
                does not fit its budget even after its policy.
        """
        messages = _checked_conversations(messages)
        if history_summary_tokens and max_prompt_tokens is None and keep_last_turns is None:
            raise InvalidParameterError("history_summary_tokens", "history_summary_tokens summarizes the turns that "
                                        "max_prompt_tokens or keep_last_turns drop; set one of them")
        tok = self.engine.tokenizer

        def prepare(conv: Sequence[Message], summary: str | None = None) -> PreparedChat:
            conv = list(conv)  # tool turns (content None beside tool_calls) rendered as the server renders them
            return prepare_chat(conv, ToolTemplate(tok, None) if has_tool_turns(conv) else tok, documents=documents,
                                max_context_tokens=max_context_tokens, top_k_documents=top_k_documents,
                                reorder_documents=reorder_documents,
                                max_prompt_tokens=max_prompt_tokens, keep_last_turns=keep_last_turns,
                                add_generation_prompt=add_generation_prompt,
                                history_summary_tokens=history_summary_tokens, summary=summary)

        prepared = [prepare(conv) for conv in messages]
        for i, p in enumerate(prepared):
            if p.summary_status == "pending":
                prepared[i] = self._with_summary(messages[i], p, history_summary_tokens, prepare)
        self.last_chat_context = prepared
        return self._run([p.prompt_token_ids for p in prepared], sampling_params, use_tqdm)

    def _with_summary(self, conv: Sequence[Message], pending: PreparedChat, n: int, prepare: Any) -> PreparedChat:
        """``conv`` prepared again with the summary of its dropped messages (computed greedily, or reused)."""
        key = summary_key(self.engine.config.model or "", n, pending.summary_messages)
        text = self._summaries.get(key)
        reused = text is not None
        if text is None:
            try:  # a summary that cannot run (N beyond the context, ...) falls back to plain dropping
                ids = summary_prompt(pending.summary_messages, self.engine.tokenizer,
                                     max(1, self.engine.max_model_len - n))
                out = self._run([ids], SamplingParams(temperature=0.0, max_tokens=n), False)[0]
                text = out.outputs[0].text.strip()
            except LeanserveError as exc:
                text, error = "", f"{type(exc).__name__}: {exc}"
            else:
                error = "the model returned an empty summary"
            if not text:
                pending.summary_status, pending.summary_reason = "failed", error
                return pending
            self._summaries.put(key, text)
        prepared = prepare(conv, text)
        if prepared.summary_status == "applied":  # as the server reports it
            prepared.summary_status = "reused" if reused else "computed"
        return prepared

    @staticmethod
    def _prompt_of(p: PromptType) -> str | list[int]:
        if isinstance(p, str):
            return p
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if isinstance(p, dict) and isinstance(p.get("prompt"), str):
            return p["prompt"]
        raise InvalidParameterError("prompt", "a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(self, prompts: list[str | list[int]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params]
            bad = next((p for p in params_list if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise InvalidParameterError("sampling_params", "sampling_params must be a SamplingParams or a list "
                                            f"of them, got {type(bad).__name__}")
            if len(params_list) != len(prompts):
                raise InvalidParameterError("sampling_params", f"got {len(params_list)} sampling params for "
                                            f"{len(prompts)} prompts")
        engine = self.engine
        admitted = [engine.admit(p, params) for p, params in zip(prompts, params_list, strict=True)]  # all, first
        ids = [f"llm-{next(self._ids)}" for _ in admitted]
        for rid, request in zip(ids, admitted, strict=True):
            engine.add_admitted(rid, request)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in ids]


def _checked_conversations(messages: Any) -> list[list[Message]]:
    """One conversation or a list of them (lists or tuples), each message checked and returned as the chat
    template sees it: content as one string (text parts joined; an assistant's None as ``""``), ``developer`` as
    ``system``, every other key (``name``, ``tool_calls``, ``tool_call_id``, ...) kept as given. As vLLM's
    ``LLM.chat``, any role name is taken (``ipython``, ...) and a tool message needs no ``tool_call_id``; a
    tool call's ``arguments`` may be its JSON text (OpenAI's form) or an object (Hugging Face's).

    Raises:
        InvalidParameterError: ``param="messages"``: not a list of messages (or of lists of them), an empty
            conversation, a message that is not a dict, a role that is not a string, content missing (outside
            an assistant message) or not a string or a list of text parts, or a tool call without a function
            name; the message names its place, as ``messages.0.content``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidParameterError("messages", "messages must be a non-empty list of {'role', 'content'} dicts "
                                    f"(or a list of such lists), got {type(messages).__name__}"
                                    + (" (empty)" if isinstance(messages, Sequence) and not messages else ""))
    single = isinstance(messages[0], dict)
    out = []
    for i, conv in enumerate([messages] if single else messages):
        where = "messages" if single else f"messages.{i}"
        if isinstance(conv, (str, bytes, dict)) or not isinstance(conv, Sequence) or not conv:
            raise InvalidParameterError("messages", f"{where} must be a non-empty list of messages")
        out.append([_checked_message(m, f"{where}.{j}") for j, m in enumerate(conv)])
    return out


def _checked_message(m: Any, where: str) -> Message:
    """One message of :func:`_checked_conversations`, as the template sees it (a new dict)."""
    def bad(field: str, why: str) -> InvalidParameterError:
        return InvalidParameterError("messages", f"{where}{field}: {why}")

    if not isinstance(m, dict):
        raise bad("", f"a message is a dict with 'role' and 'content', got {type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise bad(".role", f"a message needs a role (a non-empty string), got {role!r}")
    if isinstance(content, (list, tuple)):
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f".content.{k}", f"only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                          f"got {kind!r}")
        content = "".join(p["text"] for p in content)
    elif content is None:
        if role != "assistant":
            raise bad(".content", f"a {role} message needs content (a string or text parts)")
        content = ""
    elif not isinstance(content, str):
        raise bad(".content", f"content is a string or a list of text parts, got {type(content).__name__}")
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, (list, tuple)):
            raise bad(".tool_calls", f"tool_calls is a list, got {type(calls).__name__}")
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f".tool_calls.{k}", "a tool call is {'function': {'name': ..., 'arguments': ...}}")
            if not isinstance(fn.get("arguments", {}), (str, dict)):
                raise bad(f".tool_calls.{k}.function.arguments", "arguments are JSON text or an object")
        calls = list(calls)
    checked = {**m, "role": "system" if role == "developer" else role, "content": content}
    if calls is not None:
        checked["tool_calls"] = calls
    return checked
