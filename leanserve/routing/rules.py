"""The rules router: the strong model for long prompts, long requested answers, code or math; else the cheap one."""

from __future__ import annotations

from leanserve.errors import RouterConfigError
from leanserve.routing.base import RouteDecision, RouteInput
from leanserve.routing.detect import detect_code, detect_math


class RulesPolicy:
    """Routes by fixed rules, checked in this order (the first that matches sends the request to ``strong``):

    1. ``prompt_tokens > max_cheap_prompt_tokens`` (None: no limit);
    2. ``max_tokens > max_cheap_max_tokens`` (None: no limit; a request without ``max_tokens`` never matches);
    3. ``code`` and :func:`~leanserve.routing.detect.detect_code` finds code in the text;
    4. ``math`` and :func:`~leanserve.routing.detect.detect_math` finds math in the text.

    Otherwise ``cheap``. Decisions carry no score.

    Raises:
        RouterConfigError: a limit that is not a positive integer (``param`` names it).
    """

    kind = "rules"

    def __init__(self, cheap: str, strong: str, max_cheap_prompt_tokens: int | None = None,
                 max_cheap_max_tokens: int | None = None, code: bool = True, math: bool = True) -> None:
        for name, value in (("max_cheap_prompt_tokens", max_cheap_prompt_tokens),
                            ("max_cheap_max_tokens", max_cheap_max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RouterConfigError(name, f"{name} must be a positive integer or null, got {value!r}")
        for name, value in (("code", code), ("math", math)):
            if not isinstance(value, bool):
                raise RouterConfigError(name, f"{name} must be true or false, got {value!r}")
        self.cheap, self.strong = cheap, strong
        self.max_cheap_prompt_tokens, self.max_cheap_max_tokens = max_cheap_prompt_tokens, max_cheap_max_tokens
        self.code, self.math = code, math

    def decide(self, request: RouteInput) -> RouteDecision:
        limit = self.max_cheap_prompt_tokens
        if limit is not None and request.prompt_tokens > limit:
            return self._strong(f"prompt of {request.prompt_tokens} tokens > {limit}")
        limit = self.max_cheap_max_tokens
        if limit is not None and request.max_tokens is not None and request.max_tokens > limit:
            return self._strong(f"max_tokens {request.max_tokens} > {limit}")
        if self.code and (why := detect_code(request.text)):
            return self._strong(f"code in prompt ({why})")
        if self.math and (why := detect_math(request.text)):
            return self._strong(f"math in prompt ({why})")
        return RouteDecision(self.cheap, self.kind, "rules: no rule matched")

    def _strong(self, why: str) -> RouteDecision:
        return RouteDecision(self.strong, self.kind, f"rules: {why}")
