"""The summary of dropped turns: its key, cache, placement and budget (leanserve.context.summary, prepare_chat),
and the server's single flight (entrypoints/openai/history_summary.py), on the word tokenizer."""

from __future__ import annotations

import asyncio

from leanserve.context.chat import prepare_chat
from leanserve.context.summary import (
    SUMMARY_PREFIX,
    SummaryCache,
    summary_key,
    summary_message,
    summary_prompt,
    with_summary,
)
from leanserve.entrypoints.openai.history_summary import HistorySummarizer, SummaryResult
from leanserve.errors import InvalidParameterError

import pytest
from fake_tokenizer import WordTokenizer

TOK = WordTokenizer()
PREFIX_WORDS = len(SUMMARY_PREFIX.split())


def conv(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):  # each turn: 2 + 10 words, 2 + 10 words
        msgs += [{"role": "user", "content": f"q{i} " + "w " * 10},
                 {"role": "assistant", "content": f"a{i} " + "x " * 10}]
    return msgs + [{"role": "user", "content": "last question"}]


def test_key_is_the_model_budget_and_the_messages_exactly():
    m = conv(2)[1:5]
    assert summary_key("m", 32, m) == summary_key("m", 32, [dict(x) for x in m])
    assert summary_key("m", 32, m) != summary_key("other", 32, m)
    assert summary_key("m", 32, m) != summary_key("m", 16, m)
    assert summary_key("m", 32, m, "tenant-a") != summary_key("m", 32, m, "tenant-b") != summary_key("m", 32, m)
    assert summary_key("m", 32, m) != summary_key("m", 32, m[:-1] + [{**m[-1], "content": m[-1]["content"] + "."}])


def test_cache_is_a_bounded_lru():
    c = SummaryCache(2)
    c.put("a", "1")
    c.put("b", "2")
    assert c.get("a") == "1"  # a is now the most recent
    c.put("c", "3")
    assert (c.get("a"), c.get("b"), c.get("c"), len(c)) == ("1", None, "3", 2)


def test_summary_goes_right_after_the_leading_system_messages():
    msgs = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    out = with_summary(msgs, "earlier: x")
    assert out[2] == summary_message("earlier: x") == {"role": "system", "content": SUMMARY_PREFIX + "earlier: x"}
    assert [m["role"] for m in out] == ["system", "developer", "system", "user"]
    assert with_summary([{"role": "user", "content": "u"}], "t")[0]["role"] == "system"


def test_pending_then_applied_with_the_room_reserved_in_the_budget():
    msgs = conv(6)
    n = 10
    pending = prepare_chat(msgs, TOK, max_prompt_tokens=60, history_summary_tokens=n)
    plain = prepare_chat(msgs, TOK, max_prompt_tokens=60)
    assert pending.summary_status == "pending"
    assert pending.prompt_token_ids == plain.prompt_token_ids and pending.dropped_messages == plain.dropped_messages
    # the cut leaves room for n words plus the summary message's own (role word + prefix)
    room = n + 1 + PREFIX_WORDS
    reserved = prepare_chat(msgs, TOK, max_prompt_tokens=60 - room)
    assert pending.summary_source == reserved.dropped_messages
    assert pending.summary_messages == [msgs[i] for i in reserved.dropped_messages]
    text = " ".join(["s"] * n)
    applied = prepare_chat(msgs, TOK, max_prompt_tokens=60, history_summary_tokens=n, summary=text)
    assert applied.summary_status == "applied" and applied.dropped_messages == pending.summary_source
    assert applied.messages[1] == summary_message(text)
    assert len(applied.prompt_token_ids) == len(reserved.prompt_token_ids) + room <= 60


def test_a_summary_over_the_budget_is_skipped():
    msgs = conv(6)
    skipped = prepare_chat(msgs, TOK, max_prompt_tokens=60, history_summary_tokens=55)
    assert skipped.summary_status == "skipped" and "does not fit" in skipped.summary_reason
    long = prepare_chat(msgs, TOK, max_prompt_tokens=60, history_summary_tokens=10, summary="w " * 40)
    assert long.summary_status == "skipped" and "over max_prompt_tokens=60" in long.summary_reason
    assert long.prompt_token_ids == prepare_chat(msgs, TOK, max_prompt_tokens=60).prompt_token_ids


def test_no_drop_no_summary_and_bad_values():
    assert prepare_chat(conv(1), TOK, max_prompt_tokens=500, history_summary_tokens=10).summary_status is None
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidParameterError) as e:
            prepare_chat(conv(1), TOK, keep_last_turns=1, history_summary_tokens=bad)
        assert e.value.param == "history_summary_tokens"


class _DecodingWords(WordTokenizer):
    def encode(self, text, add_special_tokens=True):
        return text.split()

    def decode(self, ids):
        return " ".join(ids)


def test_summary_prompt_leaves_out_the_oldest_messages_to_fit():
    tok = _DecodingWords()
    msgs = conv(6)[1:13]
    full = summary_prompt(msgs, tok, 10_000)
    assert "q0" in full and "a5" in full
    cut = summary_prompt(msgs, tok, len(full) - 5)
    assert len(cut) <= len(full) - 5 and "q0" not in cut and "a5" in cut
    tiny = summary_prompt(msgs, tok, 40)  # the last message alone is cut from its start
    assert len(tiny) <= 40 and "a5" not in tiny
    assert tiny[-5:] == ["x", "Summarize", "this", "conversation.", "assistant:"]


class _CountingWords(_DecodingWords):
    def __init__(self):
        self.renders = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.renders += 1
        return super().apply_chat_template(messages, add_generation_prompt, **kwargs)


@pytest.mark.parametrize("budget", [1000, 60, 5])
def test_summary_prompt_renders_the_transcript_a_logarithmic_number_of_times(budget):
    import math

    tok = _CountingWords()
    msgs = [m for i in range(1200) for m in ({"role": "user", "content": f"q{i} " + "w " * 10},
                                              {"role": "assistant", "content": f"a{i} " + "x " * 10})]
    ids = summary_prompt(msgs, tok, budget)
    assert tok.renders <= math.ceil(math.log2(len(msgs))) + 3, tok.renders  # was one per message left out
    if budget >= 60:
        assert len(ids) <= budget
    else:  # under the template's own words: the last message's last word alone
        assert ids[-5:] == ["x", "Summarize", "this", "conversation.", "assistant:"] and "a1199" not in ids
    if budget == 1000:  # the fewest messages left out: one more message would not fit
        kept = sum(1 for m in msgs if m["content"].split()[0] in ids)
        assert len(summary_prompt(msgs[-(kept + 1):], _DecodingWords(), 10**6)) > 1000 >= len(ids)
        assert msgs[-1]["content"].split()[0] in ids


def test_concurrent_requests_with_one_dropped_prefix_compute_once():
    s = HistorySummarizer(engine=None, model_name="m")
    calls = []

    async def fake_run(messages, max_tokens):
        calls.append(messages)
        await asyncio.sleep(0.05)
        return SummaryResult("the summary", False, 100, 7)

    s._run = fake_run
    msgs = conv(2)[1:5]

    async def main():
        return await asyncio.gather(*[s.summarize(msgs, 32) for _ in range(5)])

    results = asyncio.run(main())
    assert len(calls) == 1
    assert sorted(r.reused for r in results) == [False, True, True, True, True]
    assert {r.text for r in results} == {"the summary"}
    assert sum(r.completion_tokens for r in results) == 7  # counted on the request that ran it
    again = asyncio.run(s.summarize(msgs, 32))
    assert again.reused and len(calls) == 1


def test_a_failed_summary_is_not_cached():
    s = HistorySummarizer(engine=None, model_name="m")
    outcomes = [SummaryResult(None, False, error="QueueFullError: busy"), SummaryResult("ok", False, 5, 1)]

    async def fake_run(messages, max_tokens):
        return outcomes.pop(0)

    s._run = fake_run
    assert asyncio.run(s.summarize(conv(1)[1:3], 8)).error == "QueueFullError: busy"
    assert asyncio.run(s.summarize(conv(1)[1:3], 8)).text == "ok"
