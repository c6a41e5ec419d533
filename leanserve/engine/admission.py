"""The one admission check of a request: its prompt, sampling parameters and lengths, validated and resolved once.

Every entry point (``LLM``, ``LLMEngine.add_request``, the HTTP server through ``AsyncEngine``) calls
:meth:`RequestAdmission.admit`; what it returns, an :class:`AdmittedRequest`, is accepted by
``LLMEngine.add_admitted`` without further checks. ``SamplingParams`` validates each parameter's type and range
on construction; admission adds what needs the model and the KV pool: the prompt's tokens, stop ids against the
vocabulary, prompt + ``max_tokens`` against the context, and the request against the KV pool's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leanserve.context.truncate import truncate_prompt
from leanserve.core.kv_cache_manager import cdiv
from leanserve.errors import ContextLengthExceededError, InvalidParameterError, KVCapacityError
from leanserve.sampling_params import SamplingParams
from leanserve.structured.grammar import GrammarCompiler
from leanserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class AdmittedRequest:
    """A validated request, ready for the scheduler.

    Attributes:
        prompt: the prompt's text when it was given as text, else None.
        prompt_token_ids: the prompt's token ids (BOS included per the model), all in ``[0, vocab_size)``.
        params: its sampling parameters (``params.n`` sequences share the prompt).
        max_tokens: the resolved limit on output tokens: ``params.max_tokens``, or what is left of the context
            and the KV pool when that is None; prompt + max_tokens fits both.
        grammar: the compiled grammar of ``params.structured_outputs`` (an ``xgrammar.CompiledGrammar``), or None.
        num_sent_tokens: the prompt's length in tokens as sent, before ``truncate_prompt_tokens`` cut it.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: Any = None
    num_sent_tokens: int = 0


class RequestAdmission:
    """Validates requests against an engine's fixed settings; thread-safe (it reads nothing that changes).

    Args:
        tokenizer: the model's tokenizer (encodes text prompts).
        vocab_size: token ids must be below it.
        max_model_len: longest sequence, prompt + output, in tokens.
        block_size: tokens per KV block.
        num_blocks: blocks in the whole KV pool.
        grammars: compiles structured-output constraints (default: one for ``tokenizer`` and ``vocab_size``).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_blocks * self.block_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (BOS added per the model) or a checked copy of a list of ids.

        Raises:
            InvalidParameterError: ``param="prompt"``: empty prompt, or ids that are not integers in the vocabulary.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise InvalidParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        return ids

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt that is only echoed, never extended (``echo`` with ``max_tokens: 0``): it must fit
        the context.

        Raises:
            InvalidParameterError: a bad prompt (see :meth:`tokenize`). ContextLengthExceededError: longer than
                ``max_model_len``.
        """
        if isinstance(prompt, str):
            self._check_text_length(prompt, room=False)
        ids = self.tokenize(prompt)
        if len(ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(ids)} tokens.", param="prompt")
        return ids

    def admit(self, prompt: str | list[int], params: SamplingParams) -> AdmittedRequest:
        """Validate ``prompt`` with ``params`` and resolve its output-token limit.

        Raises:
            InvalidParameterError: a bad prompt, ``stop_token_ids`` outside the vocabulary, ``min_tokens`` that
                cannot fit, or a ``truncate_prompt_tokens`` over the context (the prompt is left-truncated to it
                first, :func:`leanserve.context.truncate.truncate_prompt`).
            ContextLengthExceededError: prompt (+ ``max_tokens``) longer than ``max_model_len``; ``param`` is
                "prompt" or "max_tokens".
            KVCapacityError: prompt + output cannot fit in the whole KV pool.
            InvalidGrammarError: ``params.structured_outputs`` is an invalid or unsupported constraint
                (param ``"structured_outputs"``).
        """
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidParameterError("stop_token_ids",
                                        f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if isinstance(prompt, str) and params.truncate_prompt_tokens is None:
            self._check_text_length(prompt)
        sent = self.tokenize(prompt)
        ids = truncate_prompt(sent, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        return AdmittedRequest(prompt if isinstance(prompt, str) else None, ids, params, max_tokens, grammar,
                               len(sent))

    def _check_text_length(self, text: str, room: bool = True) -> None:
        """Reject a text that cannot fit the context before tokenizing it (megabytes take seconds): its
        token count is at least :meth:`Tokenizer.min_num_tokens`.

        Raises:
            ContextLengthExceededError: ``param="prompt"``: the bound exceeds ``max_model_len``, or (``room``)
                leaves no room for a completion.
        """
        bound = self.tokenizer.min_num_tokens(text)
        if bound > self.max_model_len - int(room):
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"at least {bound} tokens ({len(text)} characters)"
                + (", which leaves no room for a completion." if room else "."), param="prompt")

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens, which leaves no room for a completion.", param="prompt")
        if params.max_tokens is not None:
            if num_prompt + params.max_tokens > limit:
                raise ContextLengthExceededError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                    f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                    param="max_tokens")
            max_tokens = params.max_tokens
        else:
            max_tokens = max(1, min(limit, self.kv_capacity_tokens) - num_prompt)
        if cdiv(num_prompt + 1, self.block_size) > self.num_blocks:
            raise KVCapacityError(
                f"the prompt has {num_prompt} tokens but the KV cache holds {self.kv_capacity_tokens} tokens; "
                f"shorten the prompt or raise kv_cache_memory", param="prompt")
        if cdiv(num_prompt + max_tokens, self.block_size) > self.num_blocks:
            raise KVCapacityError(
                f"the request needs {num_prompt + max_tokens} tokens of KV cache ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion) but the KV cache holds {self.kv_capacity_tokens} tokens; "
                f"reduce max_tokens or the prompt, or raise kv_cache_memory")
        if params.min_tokens > max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"min_tokens={params.min_tokens} does not fit: the prompt has {num_prompt} tokens "
                f"and at most {max_tokens} more fit in the context ({limit}) and the KV cache "
                f"({self.kv_capacity_tokens})")
        return max_tokens
