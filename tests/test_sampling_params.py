"""SamplingParams: defaults, normalization and the InvalidParameterError of every bad value."""

from leanserve.errors import InvalidParameterError
from leanserve.sampling_params import SamplingParams

import pytest


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.is_greedy


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (0, True), (9e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_valid_combinations_pass_and_normalize():
    p = SamplingParams(
        n=3,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.3,
        seed=2**64 - 1,
        max_tokens=None,
        min_tokens=100,
        ignore_eos=True,
        stop="###",
        stop_token_ids=(7, 0),
        include_stop_str_in_output=True,
        logprobs=20,
        skip_special_tokens=False,
    )
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 0]
    assert isinstance(p.temperature, float) and isinstance(p.min_p, float)
    assert isinstance(p.presence_penalty, float) and p.presence_penalty == -2.0
    assert SamplingParams(seed=-(2**63), logprobs=0, top_k=5, max_tokens=1, min_tokens=1).top_k == 5
    assert SamplingParams(stop=["a", "bc"], stop_token_ids=None, top_p=1e-9).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": "0.9"}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": [1]}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > default max_tokens 16
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": 0.0}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 2.0}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_parameter_names_the_param(kwargs, param):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert str(info.value)  # carries a message


def test_min_tokens_unbounded_when_max_tokens_none():
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000


def test_stop_list_is_copied():
    stops = ["a"]
    p = SamplingParams(stop=stops)
    stops.append("b")
    assert p.stop == ["a"]


@pytest.mark.parametrize("name", ["max_tokens", "n", "seed", "min_tokens", "truncate_prompt_tokens"])
def test_integers_beyond_64_bits_are_refused(name):
    with pytest.raises(InvalidParameterError, match=f"{name} must be below 2\\*\\*64 in magnitude"):
        SamplingParams(**{name: int("9" * 4300)})
