"""What every router policy sees and returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RouteInput:
    """One request as a policy sees it.

    Attributes:
        text: what the user asked: a completion's prompt, or a chat's user messages joined by newlines (not the
            chat template, the system prompt or documents).
        prompt_tokens: the prompt as the model will see it, in tokens (template included).
        max_tokens: the request's ``max_tokens`` (None: not given).
    """

    text: str
    prompt_tokens: int = 0
    max_tokens: int | None = None

    @classmethod
    def from_chat(cls, messages: Sequence[dict[str, Any]], prompt_tokens: int = 0,
                  max_tokens: int | None = None) -> RouteInput:
        """The input of a chat request: the text of its ``user`` messages (a string content, or the ``text`` of
        each ``{"type": "text"}`` part of a list content), joined by newlines; other roles are left out."""
        texts = []
        for message in messages:
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(part["text"] for part in content if isinstance(part, dict)
                             and part.get("type") == "text" and isinstance(part.get("text"), str))
        return cls("\n".join(texts), prompt_tokens, max_tokens)


@dataclass(frozen=True)
class RouteDecision:
    """Which model answers, and why.

    Attributes:
        model: the served model name that answers.
        policy: the policy kind (``"rules"``, ``"learned"`` or ``"cascade"``).
        reason: a short human string for the response's extension field, e.g. ``"rules: code in prompt (fenced
            code)"`` or ``"learned: score 0.71 >= threshold 0.55"``.
        score: the policy's number behind the decision (learned: the hardness score in [0, 1]; cascade: the mean
            token logprob once judged), None when there is none.
    """

    model: str
    policy: str
    reason: str
    score: float | None = None


class RouterPolicy(Protocol):
    """The interface the server uses: ``decide`` once per request (the cascade's ``decide`` is its ``first``)."""

    kind: str
    cheap: str
    strong: str

    def decide(self, request: RouteInput) -> RouteDecision: ...
