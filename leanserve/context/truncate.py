"""``truncate_prompt_tokens``: keep the last k tokens of a prompt (vLLM's left truncation).

vLLM's semantics (``SamplingParams.truncate_prompt_tokens``, https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html):
an integer k >= 1 keeps only the last k prompt tokens; -1 means "the truncation size the model supports". Here -1
keeps the longest suffix that still leaves room in the context for the completion: ``max_model_len -
max_tokens`` tokens, or ``max_model_len - 1`` when ``max_tokens`` is None (vLLM truncates to ``max_model_len``
itself, which leaves no room for a single output token and is refused at admission anyway).
"""

from __future__ import annotations

from leanserve.errors import InvalidParameterError


def check_truncate_prompt_tokens(value: object) -> None:
    """Raises InvalidParameterError("truncate_prompt_tokens") unless ``value`` is None, -1 or an int >= 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise InvalidParameterError("truncate_prompt_tokens",
                                    f"truncate_prompt_tokens must be -1 (the model's limit) or an integer >= 1, "
                                    f"got {value!r}")


def truncation_size(k: int, max_model_len: int, max_tokens: int | None) -> int:
    """How many tokens ``truncate_prompt_tokens=k`` keeps.

    Raises:
        InvalidParameterError("truncate_prompt_tokens"): k > ``max_model_len`` (as vLLM), or -1 with
            ``max_tokens`` >= ``max_model_len`` (no prompt token would fit).
    """
    check_truncate_prompt_tokens(k)
    if k == -1:
        keep = max_model_len - (max_tokens if max_tokens is not None else 1)
        if keep < 1:
            raise InvalidParameterError("truncate_prompt_tokens",
                                        f"truncate_prompt_tokens=-1 leaves no prompt token: max_tokens ({max_tokens})"
                                        f" fills the model's context ({max_model_len})")
        return keep
    if k > max_model_len:
        raise InvalidParameterError("truncate_prompt_tokens",
                                    f"truncate_prompt_tokens ({k}) must be at most the model's context length "
                                    f"({max_model_len})")
    return k


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int, max_tokens: int | None) -> list[int]:
    """The last ``truncation_size(k, ...)`` tokens of ``ids`` (all of them when k is None or the prompt is
    shorter). Raises as :func:`truncation_size`."""
    if k is None:
        return ids
    keep = truncation_size(k, max_model_len, max_tokens)
    return ids[-keep:] if len(ids) > keep else ids
