"""OutputProcessor on its own, with a tiny byte-level fake tokenizer: incremental text, held-back stop strings,
EOS / stop-token / stop-string / length / abort endings, n > 1 choices, snapshot contents and logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from leanserve.core.request import Request, RequestStatus
from leanserve.engine.output_processor import OutputProcessor, ParentState
from leanserve.outputs import Logprob
from leanserve.sampling_params import SamplingParams
from leanserve.worker.sampler import TokenLogprobs

import pytest

EOS = 0
VOCAB = {
    EOS: b"<eos>",  # special
    1: b"Hello",
    2: b" world",
    3: b"!",
    4: b" E",
    5: b"N",
    6: b"D",
    7: b" more",
    8: b"\xe2\x82",  # the first two bytes of the euro sign
    9: b"\xac",  # its last byte
    10: b"\n",
}


class FakeTokenizer:
    """Byte-level: a token is a byte string; decode joins them and decodes UTF-8 (U+FFFD for broken bytes)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return VOCAB[token_id]


PROMPT = [1, 2]


def make(rid: str = "r", prompt: str | None = "Hello world", n: int = 1, **params):
    """A processor with one user request of ``n`` choices (ids ``rid`` or ``rid#i``)."""
    sp = SamplingParams(n=n, **params)
    children = [Request(rid if n == 1 else f"{rid}#{i}", list(PROMPT), sp, 16, frozenset({EOS}))
                for i in range(n)]
    proc = OutputProcessor(FakeTokenizer())
    proc.add(ParentState(rid, prompt, list(PROMPT)), children)
    return proc, children


def step(proc: OutputProcessor, req: Request, tokens: list[int], status: RequestStatus | None = None,
         logprobs: TokenLogprobs | None = None, stop_reason: int | None = None) -> bool:
    """What the scheduler and engine do around ``update``: append the tokens, maybe finish the request."""
    req.output_token_ids.extend(tokens)
    if status is not None:
        req.status = status
        req.stop_reason = stop_reason
    return proc.update(req, tokens, logprobs)


def end(proc: OutputProcessor, req: Request, status: RequestStatus | None = None):
    if status is not None:
        req.status = status
    proc.finish(req)
    return proc.snapshot(req)


# ------------------------------------------------------------------------------------------------- text
def test_incremental_text_and_token_deltas():
    proc, (req,) = make()
    deltas = []
    for tokens in ([1], [2], [3, 10]):
        assert step(proc, req, tokens) is False
        out = proc.snapshot(req)
        (c,) = out.outputs
        deltas.append(c.delta_text)
        assert c.delta_token_ids == tokens and c.finish_reason is None and not out.finished
    assert deltas == ["Hello", " world", "!\n"]
    assert c.text == "Hello world!\n" and c.token_ids == [1, 2, 3, 10]


def test_a_split_utf8_character_is_held_until_complete():
    proc, (req,) = make()
    step(proc, req, [1])
    assert proc.snapshot(req).outputs[0].delta_text == "Hello"
    step(proc, req, [8])
    c = proc.snapshot(req).outputs[0]
    assert c.delta_text == "" and c.text == "Hello" and c.delta_token_ids == [8]
    step(proc, req, [9])
    c = proc.snapshot(req).outputs[0]
    assert c.delta_text == "\u20ac" and c.text == "Hello\u20ac"


def test_a_split_character_at_the_end_is_dropped_not_shown_as_replacement():
    proc, (req,) = make()
    step(proc, req, [1])
    proc.snapshot(req)
    step(proc, req, [8], RequestStatus.FINISHED_LENGTH)
    out = end(proc, req)
    (c,) = out.outputs
    assert c.text == "Hello" and c.delta_text == "" and c.finish_reason == "length"
    assert c.token_ids == [1, 8]


# ---------------------------------------------------------------------------------------------- stop strings
def test_a_possible_stop_string_is_held_back_then_cut():
    proc, (req,) = make(stop=["END"])
    deltas = []
    for tokens in ([1], [4], [5]):
        assert step(proc, req, tokens) is False
        deltas.append(proc.snapshot(req).outputs[0].delta_text)
    assert deltas == ["Hello", " ", ""]  # "E", then "EN" may become "END"
    assert step(proc, req, [6]) is True  # the detokenizer found the stop string: the caller finishes it
    assert proc.snapshot(req).outputs[0].delta_text == ""
    out = end(proc, req, RequestStatus.FINISHED_STOPPED)
    (c,) = out.outputs
    assert c.text == "Hello " and c.finish_reason == "stop" and c.stop_reason == "END"
    assert c.token_ids == [1, 4, 5, 6]  # the tokens stay, only the text is cut
    assert out.finished


def test_include_stop_str_in_output_releases_the_stop_string():
    proc, (req,) = make(stop=["END"], include_stop_str_in_output=True)
    deltas = []
    for tokens in ([1], [4], [5], [6]):
        stopped = step(proc, req, tokens)
        deltas.append(proc.snapshot(req).outputs[0].delta_text)
    assert stopped is True
    assert deltas == ["Hello", " ", "", "END"]
    c = end(proc, req, RequestStatus.FINISHED_STOPPED).outputs[0]
    assert c.text == "Hello END" and c.stop_reason == "END" and c.finish_reason == "stop"


def test_held_back_text_that_is_no_stop_string_is_released_later():
    proc, (req,) = make(stop=["END"])
    deltas = []
    for tokens in ([4], [5], [7]):
        assert step(proc, req, tokens) is False
        deltas.append(proc.snapshot(req).outputs[0].delta_text)
    assert deltas == [" ", "", "EN more"]


def test_held_back_text_is_flushed_when_the_request_ends_otherwise():
    proc, (req,) = make(stop=["END"])
    step(proc, req, [1])
    proc.snapshot(req)
    step(proc, req, [4], RequestStatus.FINISHED_LENGTH)
    out = end(proc, req)
    (c,) = out.outputs
    assert c.delta_text == " E"  # this step's " " and the held "E" together
    assert c.text == "Hello E" and c.finish_reason == "length" and c.stop_reason is None


def test_abort_flushes_held_text_and_reports_abort():
    proc, (req,) = make(stop=["END"])
    step(proc, req, [4])
    assert proc.snapshot(req).outputs[0].delta_text == " "
    out = end(proc, req, RequestStatus.FINISHED_ABORTED)
    c = out.outputs[0]
    assert c.delta_text == "E" and c.text == " E" and c.finish_reason == "abort" and out.finished


def test_tokens_after_a_stop_string_add_no_text():
    proc, (req,) = make(stop=["!"])
    assert step(proc, req, [1, 3]) is True
    assert proc.snapshot(req).outputs[0].delta_text == "Hello"
    assert step(proc, req, [2]) is False  # already finished: ignored by the detokenizer
    c = proc.snapshot(req).outputs[0]
    assert c.delta_text == "" and c.text == "Hello" and c.token_ids == [1, 3, 2]


# ------------------------------------------------------------------------------------------- finish reasons
def test_eos_ends_with_stop_and_no_text():
    proc, (req,) = make()
    step(proc, req, [1])
    proc.snapshot(req)
    step(proc, req, [EOS], RequestStatus.FINISHED_STOPPED)
    out = end(proc, req)
    (c,) = out.outputs
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == "Hello" and c.delta_text == "" and c.delta_token_ids == [EOS]
    assert c.token_ids == [1, EOS]


def test_eos_text_is_dropped_even_when_special_tokens_are_kept():
    proc, (req,) = make(skip_special_tokens=False)
    step(proc, req, [1, EOS], RequestStatus.FINISHED_STOPPED)
    assert end(proc, req).outputs[0].text == "Hello"


def test_eos_text_shows_with_include_stop_str_and_special_tokens_kept():
    proc, (req,) = make(skip_special_tokens=False, include_stop_str_in_output=True)
    step(proc, req, [1, EOS], RequestStatus.FINISHED_STOPPED)
    assert end(proc, req).outputs[0].text == "Hello<eos>"


def test_stop_token_id_is_the_stop_reason_and_hidden_from_text():
    proc, (req,) = make(stop_token_ids=[3])
    step(proc, req, [1, 3], RequestStatus.FINISHED_STOPPED, stop_reason=3)
    c = end(proc, req).outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello", "stop", 3)


def test_stop_token_id_text_kept_with_include_stop_str_in_output():
    proc, (req,) = make(stop_token_ids=[3], include_stop_str_in_output=True)
    step(proc, req, [1, 3], RequestStatus.FINISHED_STOPPED, stop_reason=3)
    c = end(proc, req).outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello!", "stop", 3)


def test_length_keeps_the_last_token_text():
    proc, (req,) = make()
    step(proc, req, [1, 3], RequestStatus.FINISHED_LENGTH)
    c = end(proc, req).outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello!", "length", None)
    assert c.delta_text == "Hello!"  # the step's delta and the finish come in one snapshot


# ------------------------------------------------------------------------------------------------- snapshots
def test_snapshot_carries_prompt_ids_cached_tokens_and_metrics():
    proc, (req,) = make(rid="abc", prompt="Hello world")
    req.arrival_time, req.first_scheduled_time, req.first_token_time, req.last_token_time = 10.0, 10.5, 11.0, 12.0
    req.num_cached_tokens = 16
    step(proc, req, [1, 2])
    out = proc.snapshot(req)
    assert out.request_id == "abc" and out.prompt == "Hello world" and out.prompt_token_ids == PROMPT
    assert out.num_cached_tokens == 16 and not out.finished
    m = out.metrics
    assert m is out.outputs[0].metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time) == (
        10.0, 10.5, 11.0, 12.0, None)
    assert m.num_generation_tokens == 2
    assert m.ttft == pytest.approx(1.0) and m.tpot == pytest.approx(1.0)


def test_token_id_prompt_has_no_prompt_text():
    proc, (req,) = make(prompt=None)
    step(proc, req, [1])
    assert proc.snapshot(req).prompt is None


def test_a_delta_is_reported_once():
    proc, (req,) = make()
    step(proc, req, [1])
    first = proc.snapshot(req)
    second = proc.snapshot(req)
    assert first.outputs[0].delta_text == "Hello" and first.outputs[0].delta_token_ids == [1]
    assert second.outputs[0].delta_text == "" and second.outputs[0].delta_token_ids == []
    assert second.outputs[0].text == "Hello" and second.outputs[0].token_ids == [1]


def test_snapshots_are_copies_unaffected_by_later_steps():
    proc, (req,) = make(logprobs=0)
    step(proc, req, [1], logprobs=TokenLogprobs(1, -0.25, 1, []))
    first = proc.snapshot(req)
    step(proc, req, [2], logprobs=TokenLogprobs(2, -0.5, 1, []))
    second = proc.snapshot(req)
    c1, c2 = first.outputs[0], second.outputs[0]
    assert c1 is not c2
    assert (c1.text, c1.token_ids, len(c1.logprobs), c1.cumulative_logprob) == ("Hello", [1], 1, -0.25)
    assert (c2.text, c2.token_ids, len(c2.logprobs), c2.cumulative_logprob) == ("Hello world", [1, 2], 2, -0.75)
    c2.token_ids.append(99)  # a caller mutating its copy does not touch the processor's state
    c2.logprobs.clear()
    step(proc, req, [3], RequestStatus.FINISHED_LENGTH, logprobs=TokenLogprobs(3, -1.0, 1, []))
    c3 = end(proc, req).outputs[0]
    assert c3.token_ids == [1, 2, 3] and len(c3.logprobs) == 3


def test_cached_tokens_is_the_largest_over_the_steps():
    proc, (req,) = make()
    req.num_cached_tokens = 8
    step(proc, req, [1])
    assert proc.snapshot(req).num_cached_tokens == 8
    req.num_cached_tokens = 0  # e.g. recomputed after preemption: the first admission's hit stays reported
    step(proc, req, [2])
    assert proc.snapshot(req).num_cached_tokens == 8


def test_a_finished_request_is_forgotten():
    proc, (req,) = make(rid="x")
    assert proc.parent_of("x") == "x" and proc.children_of("x") == ["x"]
    step(proc, req, [1], RequestStatus.FINISHED_LENGTH)
    assert end(proc, req).finished
    assert proc.parents == {} and proc.child_to_parent == {}
    assert proc.parent_of("x") is None and proc.children_of("x") == []


# ----------------------------------------------------------------------------------------------------- n > 1
def test_n_choices_share_one_request_output():
    proc, (c0, c1) = make(rid="p", n=2)
    assert proc.children_of("p") == ["p#0", "p#1"]
    assert proc.parent_of("p#0") == proc.parent_of("p#1") == "p"
    assert proc.parent_of("p") is None and proc.children_of("p#0") == []

    step(proc, c0, [1])
    out = proc.snapshot(c0)
    assert out.request_id == "p" and [o.index for o in out.outputs] == [0, 1]
    assert [o.delta_text for o in out.outputs] == ["Hello", ""]
    assert [o.text for o in out.outputs] == ["Hello", ""]

    step(proc, c1, [2])
    out = proc.snapshot(c1)
    assert [o.delta_text for o in out.outputs] == ["", " world"]  # only the choice that advanced has a delta
    assert [o.delta_token_ids for o in out.outputs] == [[], [2]]
    assert [o.text for o in out.outputs] == ["Hello", " world"]
    assert out.metrics is out.outputs[0].metrics  # the first choice's (from its own last snapshot)
    assert out.outputs[1].metrics.num_generation_tokens == 1

    step(proc, c0, [3], RequestStatus.FINISHED_LENGTH)
    out = end(proc, c0)
    assert not out.finished  # choice 1 still runs
    assert [o.finish_reason for o in out.outputs] == ["length", None]
    assert "p" in proc.parents

    step(proc, c1, [EOS], RequestStatus.FINISHED_STOPPED)
    out = end(proc, c1)
    assert out.finished
    assert [(o.text, o.finish_reason) for o in out.outputs] == [("Hello!", "length"), (" world", "stop")]
    assert [o.token_ids for o in out.outputs] == [[1, 3], [2, EOS]]
    assert proc.parents == {} and proc.child_to_parent == {}


def test_n_choices_have_independent_stop_state():
    proc, (c0, c1) = make(rid="q", n=2, stop=["END"])
    assert step(proc, c0, [4, 5, 6]) is True
    assert step(proc, c1, [4, 5]) is False
    assert proc.snapshot(c0).outputs[0].text == " "
    out = proc.snapshot(c1)
    assert [o.text for o in out.outputs] == [" ", " "]  # choice 1 still holds "EN"
    assert step(proc, c1, [7]) is False
    assert proc.snapshot(c1).outputs[1].delta_text == "EN more"


def test_two_user_requests_are_kept_apart():
    proc = OutputProcessor(FakeTokenizer())
    sp = SamplingParams()
    a, b = Request("a", [1], sp, 4), Request("b", [2], sp, 4)
    proc.add(ParentState("a", None, [1]), [a])
    proc.add(ParentState("b", None, [2]), [b])
    step(proc, a, [1])
    step(proc, b, [2])
    assert proc.snapshot(a).outputs[0].text == "Hello"
    assert proc.snapshot(b).outputs[0].text == " world"
    step(proc, a, [3], RequestStatus.FINISHED_LENGTH)
    end(proc, a)
    assert list(proc.parents) == ["b"]


# ----------------------------------------------------------------------------------------------------- logprobs
def test_logprobs_are_passed_through_with_ranks_and_decoded_tokens():
    proc, (req,) = make(logprobs=2)
    first = proc.snapshot(req).outputs[0]  # before any token
    assert first.logprobs == [] and first.cumulative_logprob == 0.0
    # chosen token outside the top 2
    step(proc, req, [2], logprobs=TokenLogprobs(2, -2.5, 3, [(1, -0.25), (3, -1.5)]))
    # chosen token is the most likely one
    step(proc, req, [1], logprobs=TokenLogprobs(1, -0.125, 1, [(1, -0.125), (8, -3.0)]))
    c = proc.snapshot(req).outputs[0]
    assert c.logprobs == [
        {1: Logprob(-0.25, 1, "Hello"), 3: Logprob(-1.5, 2, "!"), 2: Logprob(-2.5, 3, " world")},
        {1: Logprob(-0.125, 1, "Hello"), 8: Logprob(-3.0, 2, "\ufffd")},  # a partial character's bytes
    ]
    assert list(c.logprobs[0]) == [1, 3, 2]  # top entries first, in rank order, then the chosen token
    assert c.cumulative_logprob == pytest.approx(-2.625)


def test_logprobs_zero_gives_only_the_chosen_token():
    proc, (req,) = make(logprobs=0)
    step(proc, req, [4], logprobs=TokenLogprobs(4, -0.75, 5, []))
    c = proc.snapshot(req).outputs[0]
    assert c.logprobs == [{4: Logprob(-0.75, 5, " E")}] and c.cumulative_logprob == -0.75


def test_logprobs_of_a_hidden_stop_token_are_still_reported():
    proc, (req,) = make(logprobs=0)
    step(proc, req, [1], logprobs=TokenLogprobs(1, -0.5, 1, []))
    step(proc, req, [EOS], RequestStatus.FINISHED_STOPPED, logprobs=TokenLogprobs(EOS, -0.25, 1, []))
    c = end(proc, req).outputs[0]
    assert c.text == "Hello"
    assert c.logprobs == [{1: Logprob(-0.5, 1, "Hello")}, {EOS: Logprob(-0.25, 1, "<eos>")}]
    assert c.cumulative_logprob == pytest.approx(-0.75)


def test_no_logprobs_requested_ignores_passed_logprobs():
    proc, (req,) = make()
    step(proc, req, [1], logprobs=TokenLogprobs(1, -0.5, 1, [(1, -0.5)]))
    c = proc.snapshot(req).outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


def test_a_stop_string_on_the_last_allowed_token_finishes_with_stop():
    """The scheduler ended the request on max_tokens in the same step the stop string completed: "stop" wins."""
    proc, (req,) = make(stop=["END"])
    for tokens in ([1], [4], [5]):
        step(proc, req, tokens)
    assert step(proc, req, [6], status=RequestStatus.FINISHED_LENGTH) is True
    (c,) = end(proc, req).outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello ", "stop", "END")


def test_an_aborted_request_reports_abort_even_when_its_flush_cuts_a_stop_string():
    proc, (req,) = make(stop=["END"])
    for tokens in ([1], [4], [5]):
        step(proc, req, tokens)
    (c,) = end(proc, req, RequestStatus.FINISHED_ABORTED).outputs
    assert c.finish_reason == "abort" and c.stop_reason is None
