"""Per-request sampling parameters, with vLLM's names, defaults and range checks.

Semantics follow vLLM's ``SamplingParams`` (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html)
and the OpenAI API reference for the penalties. Every check raises
:class:`~leanserve.errors.InvalidParameterError` naming the offending parameter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from leanserve.errors import InvalidParameterError

_SAMPLING_EPS = 1e-5  # temperatures below this mean greedy decoding (as vLLM)
MAX_LOGPROBS = 20  # most top alternatives one request may ask for (OpenAI's limit)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is a subclass of int: reject it explicitly; so are floats such as 1.0 or 1.5.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"{name} must be an integer, got {value!r}")
    if abs(value) >= 2**64:  # no count or seed is that large; sums of it would not even print
        raise InvalidParameterError(name, f"{name} must be below 2**64 in magnitude")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParameterError(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameterError(name, f"{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidParameterError(name, f"{name} must be a boolean, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's ``StructuredOutputsParams``: exactly one of the fields is set.

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is one JSON value valid under it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF / xgrammar syntax, with a ``root`` rule).
        json_object: True: the output is one JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        structural_tag: an xgrammar structural tag (its JSON text), e.g. the tool-call format of ``tools``.

    The grammar itself is compiled, and checked, at admission (``leanserve.structured.GrammarCompiler``).

    Raises:
        InvalidParameterError: (param ``"structured_outputs"``) none or several set, or a field of the wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    _KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        name = "structured_outputs"
        set_fields = [f for f in self._KINDS if getattr(self, f) is not None and getattr(self, f) is not False]
        if len(set_fields) != 1:
            raise InvalidParameterError(name, f"exactly one of {', '.join(self._KINDS)} must be set, "
                                        f"got {set_fields or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidParameterError(name, f"json must be a JSON schema (an object or its text), got {self.json!r}")
        for f in ("regex", "grammar", "structural_tag"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), str):
                raise InvalidParameterError(name, f"{f} must be a string, got {getattr(self, f)!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidParameterError(name, f"choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise InvalidParameterError(name, "choice must not be empty")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidParameterError(name, f"json_object must be a boolean, got {self.json_object!r}")

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, text)``: what identifies the compiled grammar (``json`` as canonical JSON text)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order: the output's
            return "json", text
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return "json_object", ""


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM's names and defaults).

    Attributes:
        n: completions to generate for the prompt, >= 1.
        temperature: divides the logits; >= 0, and below 1e-5 means greedy (argmax) decoding.
        top_p: nucleus sampling, keep the most likely tokens whose cumulative probability reaches
            ``top_p``; in (0, 1], 1 = off.
        top_k: keep only the ``top_k`` most likely tokens; 0 or -1 = off, else >= 1.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's; in [0, 1].
        presence_penalty: subtracted once from the logit of every token already generated; in [-2, 2].
        frequency_penalty: subtracted from a token's logit per time it was generated; in [-2, 2].
        repetition_penalty: HF/CTRL penalty over prompt and generated tokens (> 1 discourages
            repeats); > 0, 1 = off.
        seed: seed of this request's own random generator (any int torch accepts); None = derived
            from the engine's seed.
        max_tokens: most tokens to generate; None = until the context is full; else >= 1.
        min_tokens: EOS and stop tokens are suppressed (and stop strings not checked) until this many
            tokens were generated; >= 0 and <= max_tokens.
        ignore_eos: keep generating after the EOS token (the scheduler honours it).
        stop: strings that end the generation; a single string is accepted; none may be empty.
        stop_token_ids: token ids that end the generation, besides the model's EOS.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logprobs: how many top alternatives to return per generated token besides the chosen one;
            None = no logprobs; 0..20.
        prompt_logprobs: how many top alternatives to return per prompt token besides the prompt token itself
            (vLLM's semantics: ``RequestOutput.prompt_logprobs``, the first token's entry None); None = none;
            0..20. Such a request skips the prefix-cache lookup (as vLLM), so every position is computed.
        skip_special_tokens: leave special tokens out of the detokenized text.
        speculative: let the engine's speculative decoding (when configured) draft tokens for this request;
            False turns it off for this request only (the output is the same either way).
        truncate_prompt_tokens: keep only the last k prompt tokens (vLLM's left truncation), applied at
            admission; -1 = the model's limit (the longest prompt that leaves room for ``max_tokens``); None = off.
        structured_outputs: a grammar the output must follow (:class:`StructuredOutputsParams`); its mask is
            applied before each draw, and EOS is allowed only where the grammar accepts. Not with ``ignore_eos``
            or ``min_tokens`` (the grammar decides where the output ends).

    Raises:
        InvalidParameterError: on construction, when a value has the wrong type or is out of range;
            ``.param`` is the field name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    speculative: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise InvalidParameterError("n", f"n must be at least 1, got {self.n}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameterError("temperature", f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidParameterError("top_k", f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(name, f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidParameterError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )

        _check_int("seed", self.seed, optional=True)
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise InvalidParameterError("seed", f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParameterError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidParameterError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            _check_bool(name, getattr(self, name))

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)

        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, optional=True)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise InvalidParameterError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's "
                                        f"limit) or an integer >= 1, got {self.truncate_prompt_tokens}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidParameterError("structured_outputs", "structured_outputs must be a "
                                            f"StructuredOutputsParams, got {self.structured_outputs!r}")
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise InvalidParameterError(name, f"{name} cannot be combined with structured outputs: the "
                                                "grammar decides where the output ends")

        _check_int("logprobs", self.logprobs, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                                        f"got {self.prompt_logprobs}")

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise InvalidParameterError("stop", f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise InvalidParameterError("stop", f"stop strings must be strings, got {s!r}")
            if not s:
                raise InvalidParameterError("stop", "stop strings must not be empty")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids must be a list, got {ids!r}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidParameterError(
                    "stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}"
                )
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        """True when the temperature is below 1e-5: the sampler takes the argmax (no randomness)."""
        return self.temperature < _SAMPLING_EPS
