"""Prompt logprobs over HTTP, as vLLM serves them: which requests compute them, and their JSON.

* ``/v1/completions``: ``prompt_logprobs: N`` (vLLM's extension), or ``echo: true`` with ``logprobs: N`` (OpenAI's
  legacy way: the echoed prompt's tokens get logprobs, the first one ``null``), computes them; ``echo`` with
  ``max_tokens: 0`` then runs the prompt through the model and returns it alone (vLLM generates one token and drops
  it; so does leanserve, and ``usage.completion_tokens`` is 0).
* Both ``prompt_logprobs`` and ``echo`` + ``logprobs`` on ``/v1/completions``: vLLM's rule
  (``CompletionRequest.to_sampling_params`` and ``serving_completion.py``): the prompt's logprobs are computed with
  ``prompt_logprobs`` alternatives when it is set, else with ``logprobs``; ``choices[].prompt_logprobs`` shows all
  of them; the echoed prompt's legacy ``logprobs.top_logprobs`` show at most ``logprobs`` of those (plus the
  prompt's own token), so ``prompt_logprobs`` below ``logprobs`` gives the prompt part fewer alternatives than the
  completion part. The echoed ``text`` is the prompt as sent, control tokens (``<|im_start|>``) included, and
  ``text_offset`` indexes into it.
* ``/v1/chat/completions``: ``prompt_logprobs: N``, returned as the response's top-level ``prompt_logprobs``.
* ``prompt_logprobs`` above 0 with ``stream: true`` is a 400 on both endpoints (vLLM's rule); the streamed echo of
  ``echo`` + ``logprobs`` carries the prompt's logprobs in each choice's first chunk.
"""

from __future__ import annotations

from dataclasses import replace

from leanserve.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs
from leanserve.entrypoints.openai.serving_common import bad_request, to_openai_error
from leanserve.errors import InvalidParameterError
from leanserve.outputs import Logprob
from leanserve.sampling_params import SamplingParams


def requested_prompt_logprobs(prompt_logprobs: int | None, stream: bool, echo_logprobs: int | None = None
                              ) -> int | None:
    """How many alternatives per prompt token the engine computes: ``prompt_logprobs`` when given, else
    ``echo_logprobs`` (completions' ``logprobs`` when ``echo`` is set), else None.

    Raises:
        OpenAIError: 400 (param ``prompt_logprobs``) for a value above 0 with ``stream``.
    """
    if prompt_logprobs is not None and stream and prompt_logprobs > 0:
        raise bad_request("`prompt_logprobs` are not available when `stream=true`", "prompt_logprobs")
    return prompt_logprobs if prompt_logprobs is not None else echo_logprobs


def with_prompt_logprobs(params: SamplingParams, num: int | None, param: str = "prompt_logprobs") -> SamplingParams:
    """``params`` asking for ``num`` prompt logprobs (unchanged when None).

    Raises:
        OpenAIError: 400 naming ``param`` for a value out of range (0..20).
    """
    if num is None:
        return params
    try:
        return replace(params, prompt_logprobs=num)
    except InvalidParameterError as exc:
        raise to_openai_error(exc, {"prompt_logprobs": param}) from None


def prompt_logprobs_json(plp: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or ``{token_id: {logprob, rank,
    decoded_token}}``, the prompt token first; logprobs clamped to -9999 (JSON has no -inf), as vLLM's
    ``clamp_prompt_logprobs``."""
    if plp is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                                                     decoded_token=lp.decoded_token) for t, lp in e.items()}
            for e in plp]
