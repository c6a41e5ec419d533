"""trim_history: which messages remain for a given budget, worked out by hand on a word tokenizer (one token per
word: see fake_tokenizer.py), then the policy on the real model's tokenizer and chat template."""

from __future__ import annotations

from leanserve.context import count_tokens, split_turns, trim_history
from leanserve.errors import ContextLengthExceededError, InvalidParameterError

import pytest
from fake_tokenizer import WordTokenizer

TOK = WordTokenizer()
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
# tokens per message (role word + content words): 4, 4, 3, 2, 2, 2, 4, 3; generation prompt 1; total 25
CONV = [
    {"role": "system", "content": "S s s"},  # 0
    {"role": "user", "content": "u1 a b"},  # 1  turn A (7 tokens)
    {"role": "assistant", "content": "a1 x"},  # 2
    {"role": "user", "content": "u2"},  # 3  turn B (10 tokens): a tool call and its result
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # 4
    {"role": "tool", "content": "r", "tool_call_id": "c1"},  # 5
    {"role": "assistant", "content": "a2 y z"},  # 6
    {"role": "user", "content": "u3 q"},  # 7  latest user turn
]


def test_hand_counts():
    assert count_tokens(TOK, CONV) == 25
    assert split_turns(CONV) == ([0], [[1, 2], [3, 4, 5, 6]], [7])


@pytest.mark.parametrize(("budget", "kept", "tokens"), [
    (25, [0, 1, 2, 3, 4, 5, 6, 7], 25),  # fits: nothing dropped
    (24, [0, 3, 4, 5, 6, 7], 18),  # the oldest turn goes
    (18, [0, 3, 4, 5, 6, 7], 18),
    (17, [0, 7], 8),  # the tool-call turn goes whole (4 is never kept without 5)
    (8, [0, 7], 8),
])
def test_budget_drops_oldest_turns_whole(budget, kept, tokens):
    t = trim_history(CONV, TOK, max_prompt_tokens=budget, stable_step_tokens=0)
    assert t.kept == kept and t.num_tokens == tokens and t.num_tokens_sent == 25
    assert t.dropped == [i for i in range(8) if i not in kept]
    assert t.messages == [CONV[i] for i in kept]


def test_pinned_part_over_budget_is_an_error():
    with pytest.raises(ContextLengthExceededError) as e:
        trim_history(CONV, TOK, max_prompt_tokens=7)
    assert e.value.param == "max_prompt_tokens" and "8 tokens" in str(e.value)


def test_system_messages_anywhere_stay():
    conv = [CONV[1], CONV[2], {"role": "developer", "content": "d"}, CONV[3], CONV[6], CONV[7]]
    # turns [0,1] (7) and [3,4] (6) around the developer message (2); latest [5]
    t = trim_history(conv, TOK, max_prompt_tokens=13, stable_step_tokens=0)
    assert t.kept == [2, 3, 4, 5] and t.num_tokens == 2 + 6 + 3 + 1


@pytest.mark.parametrize(("step", "kept"), [
    (7, [0, 3, 4, 5, 6, 7]),  # 7 dropped tokens reach 7: the end of turn A is a cut point
    (6, [0, 3, 4, 5, 6, 7]),  # 7 reach 6: the same
    (8, [0, 7]),  # 7 reach no multiple of 8: the next cut point is the end of turn B (17 >= 16)
    (0, [0, 3, 4, 5, 6, 7]),
])
def test_stable_step_cuts_where_dropped_tokens_reach_a_multiple(step, kept):
    assert trim_history(CONV, TOK, max_prompt_tokens=24, stable_step_tokens=step).kept == kept


def test_stable_cut_holds_as_the_conversation_grows():
    """Budget 24, step 12: the cut stays after turn A while the conversation grows by a turn, so the kept
    prefix (system, turn B, ...) renders the same."""
    t1 = trim_history(CONV, TOK, max_prompt_tokens=24, stable_step_tokens=12)
    assert t1.kept == [0, 7]  # 7 dropped tokens reach no multiple of 12; 17 do: both turns
    grown = CONV + [{"role": "assistant", "content": "a3"}, {"role": "user", "content": "u4"}]
    t2 = trim_history(grown, TOK, max_prompt_tokens=24, stable_step_tokens=12)
    assert t2.kept == [0, 7, 8, 9]  # the same cut: the new turn adds to the end


def test_a_cut_that_still_fits_never_moves_as_the_conversation_grows():
    """A conversation growing a turn at a time (turns of 3-13 words): whenever the previous request's cut would
    still fit the budget, the next request keeps it (the prefix cache keeps hitting); it moves only when needed."""
    import random

    rng = random.Random(0)
    conv = [{"role": "system", "content": "S s s"}]
    prev, moves = None, 0
    for i in range(60):
        conv += [{"role": "user", "content": " ".join(["u"] * rng.randint(1, 6))},
                 {"role": "assistant", "content": " ".join(["a"] * rng.randint(1, 6))}]
        ask = conv + [{"role": "user", "content": "q q"}]
        t = trim_history(ask, TOK, max_prompt_tokens=60, stable_step_tokens=15)
        if prev is not None:
            still = [0, *range(prev, len(ask))]  # the previous cut applied to this request
            if count_tokens(TOK, [ask[j] for j in still]) <= 60:
                assert t.kept == still, f"turn {i}: the cut moved although the previous one fits"
            else:
                moves += 1
        prev = t.kept[1] if len(t.kept) > 1 else None
    assert moves >= 5  # the conversation outgrew its cut several times, and each time the cut moved on


def test_keep_last_turns():
    assert trim_history(CONV, TOK, keep_last_turns=1).kept == [0, 7]
    assert trim_history(CONV, TOK, keep_last_turns=2).kept == [0, 3, 4, 5, 6, 7]
    assert trim_history(CONV, TOK, keep_last_turns=3).kept == list(range(8))
    # both: the turn count first, then the budget
    assert trim_history(CONV, TOK, keep_last_turns=2, max_prompt_tokens=17).kept == [0, 7]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_prompt_tokens": 0}, "max_prompt_tokens"), ({"max_prompt_tokens": -5}, "max_prompt_tokens"),
    ({"keep_last_turns": 0}, "keep_last_turns"), ({"max_prompt_tokens": 1.5}, "max_prompt_tokens"),
    ({"stable_step_tokens": -1}, "stable_step_tokens"),
])
def test_bad_budgets(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        trim_history(CONV, TOK, **kwargs)
    assert e.value.param == param


def test_no_policy_keeps_everything():
    t = trim_history(CONV, TOK)
    assert t.kept == list(range(8)) and t.dropped == []


def test_real_template_40_turns():
    """The model's own template and tokenizer: 40 turns under 1,024 tokens keep the system prompt and the last
    turn, fit the budget, and the next turn keeps the same cut (the rendered kept prefix is byte-identical)."""
    from leanserve.loader import default_model_path
    from leanserve.loader.gguf_tensors import open_gguf
    from leanserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(default_model_path()))
    conv = conversation(40)
    t = trim_history(conv, tok, max_prompt_tokens=1024)
    assert t.num_tokens <= 1024 < t.num_tokens_sent
    assert t.kept[0] == 0 and t.kept[-1] == len(conv) - 1 and t.dropped == list(range(1, t.kept[1]))
    assert count_tokens(tok, t.messages) == t.num_tokens
    nxt = conv + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And one more thing?"}]
    t2 = trim_history(nxt, tok, max_prompt_tokens=1024)
    assert t2.dropped == t.dropped
    before = tok.apply_chat_template(t.messages[:-1], add_generation_prompt=False)
    assert tok.apply_chat_template(t2.messages, add_generation_prompt=True).startswith(before)


def conversation(turns: int) -> list[dict]:
    """A system prompt and ``turns`` user/assistant turns of about 50 tokens each, ending with a user message."""
    conv = [{"role": "system", "content": "You are a patient travel agent. Answer in one short sentence."}]
    for i in range(turns):
        conv.append({"role": "user", "content": f"Question {i}: what is a good thing to see in city number {i}, "
                     f"and how long should I stay there if I like museums and parks?"})
        if i < turns - 1:
            conv.append({"role": "assistant", "content": f"In city {i}, visit the old town and its museum; two "
                         "days are enough for the museums and one more for the parks."})
    return conv
