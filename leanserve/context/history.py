"""Chat history under a token budget: which messages of a conversation are sent to the model.

Policy (:func:`trim_history`):

- System and developer messages always stay, wherever they are; so does the latest user turn (the last user
  message and everything after it, e.g. an assistant tool call and its tool results).
- The rest is cut into *turns*: a turn starts at a user message and runs to the next one (messages before the
  first user message form a turn of their own). A turn is kept or dropped whole, so an assistant message with
  ``tool_calls`` is never separated from its ``tool`` results, nor an answer from its question.
- ``keep_last_turns=N`` keeps the latest user turn and the N - 1 turns before it.
- ``max_prompt_tokens=B`` drops the oldest turns until the rendered prompt (chat template applied, encoded as the
  server encodes it) has at most B tokens. To keep the kept part byte-stable across the turns of one
  conversation (so the prefix cache keeps hitting), the cut moves in steps: the tokens dropped are rounded up to
  a multiple of ``stable_step_tokens`` (default B // 4), measured on each turn's own token count, which does not
  change as the conversation grows. The next turn therefore renders the same prefix until the conversation has
  grown by about that many tokens; the price is up to that many tokens of the budget left unused. 0 = drop
  exactly the fewest turns.
- If even the pinned messages alone exceed B, :class:`~leanserve.errors.ContextLengthExceededError` is raised
  (a 400 over HTTP): nothing is cut silently and nothing pinned is cut.

Messages are dicts as the chat template takes them (``role``, ``content``, optionally ``tool_calls`` and
``tool_call_id``; an assistant message may have ``content: None`` beside its ``tool_calls``, as in OpenAI's API: the
template gets ``""`` for it, so a template that does not render ``tool_calls`` counts such a message as empty; pass
a tokenizer that renders them, e.g. :class:`leanserve.structured.tool_template.ToolTemplate`, as the server and
``LLM.chat`` do); the tokenizer is anything with ``apply_chat_template(messages, add_generation_prompt)`` and
``encode(text, add_special_tokens=False)`` (:class:`leanserve.tokenizer.Tokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leanserve.errors import ContextLengthExceededError, InvalidParameterError

PINNED_ROLES = frozenset({"system", "developer"})


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class TrimmedHistory:
    """What :func:`trim_history` kept.

    Attributes:
        messages: the kept messages, in their original order (the same objects).
        kept: their indexes in the original list; ``dropped``: the indexes of the others (ascending).
        num_tokens: tokens of the kept conversation rendered; ``num_tokens_sent``: of the whole one.
    """

    messages: list[dict[str, Any]]
    kept: list[int]
    dropped: list[int]
    num_tokens: int
    num_tokens_sent: int


def count_tokens(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                 **template_kwargs: Any) -> int:
    """Tokens of ``messages`` with the chat template applied (content None as ""), encoded without added special
    tokens."""
    text = tokenizer.apply_chat_template(for_template(messages), add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def for_template(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a ``content`` of None given as "" (an assistant message that only calls tools), the
    others as they are: a template that concatenates ``content`` fails on None."""
    return [m if not isinstance(m, dict) or m.get("content") is not None else {**m, "content": ""}
            for m in messages]


def split_turns(messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[list[int]], list[int]]:
    """(pinned indexes, earlier turns as lists of indexes oldest first, the latest user turn's indexes)."""
    pinned = [i for i, m in enumerate(messages) if m.get("role") in PINNED_ROLES]
    rest = [i for i, m in enumerate(messages) if m.get("role") not in PINNED_ROLES]
    users = [i for i in rest if messages[i].get("role") == "user"]
    start = users[-1] if users else (rest[-1] if rest else len(messages))
    latest = [i for i in rest if i >= start]
    turns: list[list[int]] = []
    for i in rest:
        if i >= start:
            break
        if not turns or messages[i].get("role") == "user":
            turns.append([])
        turns[-1].append(i)
    return pinned, turns, latest


def _check_budget(name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidParameterError(name, f"{name} must be an integer >= {minimum}, got {value!r}")


def trim_history(messages: Sequence[dict[str, Any]], tokenizer: ChatTokenizer, *,
                 max_prompt_tokens: int | None = None, keep_last_turns: int | None = None,
                 stable_step_tokens: int | None = None, add_generation_prompt: bool = True) -> TrimmedHistory:
    """Keep a conversation within ``max_prompt_tokens`` and/or its last ``keep_last_turns`` turns (the policy in
    the module docstring). With neither, everything is kept.

    Raises:
        InvalidParameterError: a budget that is not an integer >= 1 (``stable_step_tokens`` >= 0), or a message
            that is not a dict. ContextLengthExceededError(param "max_prompt_tokens"): the system/developer
            messages and the latest user turn alone exceed ``max_prompt_tokens``.
    """
    _check_budget("max_prompt_tokens", max_prompt_tokens, 1)
    _check_budget("keep_last_turns", keep_last_turns, 1)
    _check_budget("stable_step_tokens", stable_step_tokens, 0)
    if any(not isinstance(m, dict) for m in messages):
        raise InvalidParameterError("messages", "every message must be a dict")
    pinned, turns, latest = split_turns(messages)

    def render(d: int) -> list[int]:  # indexes kept when the d oldest turns are dropped
        return sorted(pinned + [i for t in turns[d:] for i in t] + latest)

    def tokens(d: int) -> int:
        return count_tokens(tokenizer, [messages[i] for i in render(d)], add_generation_prompt)

    d = 0 if keep_last_turns is None else max(0, len(turns) - (keep_last_turns - 1))
    total = tokens(0)
    num = tokens(d) if d else total
    if max_prompt_tokens is not None and num > max_prompt_tokens:
        last = len(turns)
        if tokens(last) > max_prompt_tokens:
            raise ContextLengthExceededError(
                f"the system/developer messages and the latest user turn alone have {tokens(last)} tokens, over "
                f"max_prompt_tokens={max_prompt_tokens}", param="max_prompt_tokens")
        lo, hi = d + 1, last  # the fewest dropped turns that fit: tokens() does not grow as d grows
        while lo < hi:
            mid = (lo + hi) // 2
            if tokens(mid) <= max_prompt_tokens:
                hi = mid
            else:
                lo = mid + 1
        d = _stable_cut(messages, turns, tokenizer, lo, max_prompt_tokens // 4 if stable_step_tokens is None
                        else stable_step_tokens)
        num = tokens(d)
    kept = render(d)
    dropped = sorted(set(range(len(messages))) - set(kept))
    return TrimmedHistory([messages[i] for i in kept], kept, dropped, num, total)


def _stable_cut(messages: Sequence[dict[str, Any]], turns: list[list[int]], tokenizer: ChatTokenizer,
                d_min: int, step: int) -> int:
    """The number of oldest turns to drop, >= ``d_min``: with ``step`` > 0, the first cut at or after ``d_min``
    where the tokens dropped (each turn's own count, summed) reach a new multiple of ``step``. Those cut points are
    fixed by the conversation's oldest turns alone, so while it grows the cut stays put until the prompt no longer
    fits with it (a cut that still fits is never moved)."""
    if step <= 0 or d_min == 0:
        return d_min
    base = _stub_tokens(tokenizer)
    costs = [_turn_tokens(tokenizer, [messages[i] for i in t], base) for t in turns]
    cum = [0]
    for c in costs:
        cum.append(cum[-1] + c)
    d = d_min
    while d < len(turns) and cum[d] // step <= cum[d - 1] // step:  # no multiple of step reached by turn d - 1
        d += 1
    return d


_STUB = {"role": "system", "content": ""}


def _stub_tokens(tokenizer: ChatTokenizer) -> int | None:
    """Tokens of an empty system message rendered alone; None when the template refuses one."""
    try:
        return count_tokens(tokenizer, [_STUB], add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that refuses a leading system message
        return None


def _turn_tokens(tokenizer: ChatTokenizer, turn: list[dict[str, Any]], base: int | None) -> int:
    """Tokens one turn adds to a rendered conversation: rendered after an empty system message, less that message
    alone (``base``, :func:`_stub_tokens`; so a template's default system prompt, added when a conversation starts
    without one, is not counted); the turn rendered alone when the template refuses that."""
    if base is not None:
        try:
            return max(0, count_tokens(tokenizer, [_STUB, *turn], add_generation_prompt=False) - base)
        except Exception:  # noqa: BLE001 - a template that refuses this turn after a system message
            pass
    return count_tokens(tokenizer, turn, add_generation_prompt=False)
