"""RequestAdmission, the engine's one check of a request, on a fake tokenizer (no model)."""

from __future__ import annotations

from leanserve.engine.admission import RequestAdmission
from leanserve.errors import ContextLengthExceededError, InvalidParameterError, KVCapacityError
from leanserve.sampling_params import SamplingParams

import pytest


class CharTokenizer:
    """One token per character (its code point), plus BOS = 1."""

    def encode(self, text: str) -> list[int]:
        return [1] + [ord(c) for c in text] if text else []

    def min_num_tokens(self, text: str) -> int:
        """A loose lower bound, as a real tokenizer's (longest token 4 characters)."""
        return len(text) // 4


def admission(max_model_len: int = 64, num_blocks: int = 100, block_size: int = 4) -> RequestAdmission:
    return RequestAdmission(CharTokenizer(), vocab_size=256, max_model_len=max_model_len, block_size=block_size,
                            num_blocks=num_blocks)


def test_text_and_ids_are_tokenized_and_max_tokens_kept():
    a = admission()
    r = a.admit("abc", SamplingParams(max_tokens=5))
    assert r.prompt == "abc" and r.prompt_token_ids == [1, 97, 98, 99] and r.max_tokens == 5
    r = a.admit([5, 6], SamplingParams(max_tokens=3))
    assert r.prompt is None and r.prompt_token_ids == [5, 6] and r.max_tokens == 3


def test_unset_max_tokens_resolves_to_what_context_and_pool_leave():
    assert admission(max_model_len=64).admit("abc", SamplingParams(max_tokens=None)).max_tokens == 60
    # pool of 10 blocks x 4 = 40 tokens is smaller than the context: the pool bounds it
    assert admission(max_model_len=64, num_blocks=10).admit("abc", SamplingParams(max_tokens=None)).max_tokens == 36


@pytest.mark.parametrize("prompt", ["", [], [1, 256], [1, -1], [1, True], [1, 2.0]])
def test_bad_prompts(prompt):
    with pytest.raises(InvalidParameterError) as e:
        admission().admit(prompt, SamplingParams())
    assert e.value.param == "prompt"


def test_a_text_far_over_the_context_is_refused_without_tokenizing(monkeypatch):
    a = admission(max_model_len=64)
    monkeypatch.setattr(a.tokenizer, "encode", lambda text: pytest.fail("tokenized a text the bound rules out"))
    with pytest.raises(ContextLengthExceededError) as e:
        a.admit("x" * 400, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt" and "at least 100 tokens (400 characters)" in str(e.value)


def test_context_errors_name_the_field():
    a = admission(max_model_len=8)
    with pytest.raises(ContextLengthExceededError) as e:
        a.admit("abcdefgh", SamplingParams(max_tokens=1))  # 9 prompt tokens >= 8
    assert e.value.param == "prompt" and "your prompt has 9 tokens" in str(e.value)
    with pytest.raises(ContextLengthExceededError) as e:
        a.admit("ab", SamplingParams(max_tokens=6))  # 3 + 6 = 9 > 8
    assert e.value.param == "max_tokens" and "you requested 9 tokens (3 in the prompt, 6 for the completion)" in str(
        e.value)
    assert a.admit("ab", SamplingParams(max_tokens=5)).max_tokens == 5  # 3 + 5 = 8 fits exactly


def test_kv_capacity_names_what_to_shorten():
    a = admission(max_model_len=1000, num_blocks=4, block_size=4)  # the pool holds 16 tokens
    with pytest.raises(KVCapacityError, match=r"the prompt has 19 tokens but the KV cache holds 16 tokens") as e:
        a.admit("x" * 18, SamplingParams(max_tokens=None))
    assert e.value.param == "prompt"
    with pytest.raises(KVCapacityError, match=r"needs 17 tokens of KV cache \(7 in the prompt, 10 for the "
                       r"completion\) but the KV cache holds 16 tokens"):
        a.admit("x" * 6, SamplingParams(max_tokens=10))
    with pytest.raises(KVCapacityError) as e:
        a.admit("x" * 6, SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens"
    assert a.admit("x" * 6, SamplingParams(max_tokens=9)).max_tokens == 9  # 16 tokens: exactly the pool


def test_stop_token_ids_and_min_tokens_checked_against_model_and_pool():
    with pytest.raises(InvalidParameterError) as e:
        admission().admit("a", SamplingParams(stop_token_ids=[256]))
    assert e.value.param == "stop_token_ids"
    with pytest.raises(InvalidParameterError) as e:
        admission(max_model_len=10).admit("a", SamplingParams(max_tokens=None, min_tokens=9))  # 8 tokens left
    assert e.value.param == "min_tokens"
