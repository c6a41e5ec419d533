"""truncate_prompt_tokens (vLLM's left truncation) and the answer cache object (LRU in bytes, TTL)."""

from __future__ import annotations

import tracemalloc

from leanserve.context import AnswerCache, is_deterministic, truncate_prompt, truncation_size
from leanserve.context.answer_cache import ENTRY_OVERHEAD, cache_key
from leanserve.errors import InvalidParameterError
from leanserve.sampling_params import SamplingParams

import pytest


def test_truncate_keeps_the_last_k():
    ids = list(range(10))
    assert truncate_prompt(ids, 3, 100, None) == [7, 8, 9]
    assert truncate_prompt(ids, 10, 100, None) == ids and truncate_prompt(ids, 50, 100, None) == ids
    assert truncate_prompt(ids, None, 5, None) == ids  # off: admission refuses it later, not here


def test_minus_one_is_the_model_limit():
    assert truncation_size(-1, 512, 100) == 412  # room left for max_tokens
    assert truncation_size(-1, 512, None) == 511  # at least one output token
    assert truncate_prompt(list(range(600)), -1, 512, 12) == list(range(100, 600))
    with pytest.raises(InvalidParameterError):
        truncation_size(-1, 512, 512)


@pytest.mark.parametrize("k", [0, -2, 513, 1.5, True])
def test_bad_truncation(k):
    with pytest.raises(InvalidParameterError) as e:
        truncation_size(k, 512, None)
    assert e.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("k", [0, -2, 2.0, "3"])
def test_sampling_params_checks_truncate(k):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(truncate_prompt_tokens=k)
    assert e.value.param == "truncate_prompt_tokens"
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


def test_engine_admission_truncates(llm):
    """LLM.generate with truncate_prompt_tokens computes only the last k tokens, and says so in its output."""
    ids = llm.get_tokenizer().encode("one two three four five six seven eight nine ten eleven twelve")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0,
                                                                 truncate_prompt_tokens=4))
    assert out[0].prompt_token_ids == ids[-4:]


def test_deterministic():
    assert is_deterministic(0.0, None) and is_deterministic(0.7, 3) and not is_deterministic(0.7, None)


def test_key_covers_every_part():
    base = ("t", "m", "chat", [1, 2, 3], 16, {"temperature": 0.0, "stop": [], "seed": None})
    keys = {cache_key(*base)}
    for i, alt in enumerate([("u",), ("t", "m2"), ("t", "m", "completion"), ("t", "m", "chat", [1, 2, 4])]):
        keys.add(cache_key(*alt, *base[len(alt):]))
        assert len(keys) == i + 2
    for change in ({"stop": ["x"]}, {"seed": 1}, {"temperature": 1e-6}, {"logprobs": 0}):
        keys.add(cache_key(*base[:5], {**base[5], **change}))
    assert len(keys) == 9
    assert cache_key(*base) == cache_key(*base)


def test_lru_ttl_and_bound():
    now = [0.0]
    cache = AnswerCache(max_bytes=3 * (100 + 32 + ENTRY_OVERHEAD), ttl=10.0, clock=lambda: now[0])
    for k in (b"a", b"b", b"c"):
        assert cache.put(k, bytes(100))
    assert cache.get(b"a") == bytes(100)  # a is now the most recently used
    cache.put(b"d", bytes(100))  # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    now[0] = 10.5
    assert cache.get(b"a") is None and len(cache) == 2  # expired and removed
    assert not cache.put(b"big", bytes(cache.max_bytes))  # larger than the whole bound: not stored
    assert (cache.queries, cache.hits) == (4, 2)


def test_memory_within_bound_under_10000_distinct_requests():
    """10,000 distinct entries of 1-3 KB through a 1 MiB cache: the accounted size never passes the bound,
    and the memory the cache really holds (tracemalloc) stays within it too."""
    bound = 1 << 20
    cache = AnswerCache(max_bytes=bound, ttl=3600.0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak_accounted = 0
    for i in range(10_000):
        cache.put(cache_key("tenant", "model", "chat", [i], 16, {}), bytes(1000 + (i * 37) % 2000))
        peak_accounted = max(peak_accounted, cache.nbytes)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert peak_accounted <= bound and cache.evictions > 9000
    assert held <= bound, held
    assert cache.nbytes == sum(e.nbytes for e in cache._entries.values())


def test_llm_chat_takes_the_context_options(llm):
    """LLM.chat runs the server's policies: what the server would send is what the engine computes."""
    from leanserve.context import prepare_chat

    docs = [{"id": "x", "text": "Lake Baikal is the deepest lake."}, {"id": "y", "text": "Lake Baikal is the "
                                                                                        "deepest lake!"},
            {"id": "z", "text": "The Nile is a long river."}]
    conv = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Which lake is the deepest?"}]
    out = llm.chat(conv, SamplingParams(max_tokens=2, temperature=0), documents=docs, top_k_documents=1,
                   keep_last_turns=1)
    (ctx,) = llm.last_chat_context
    assert ctx.documents_used == ["x"] and ctx.documents_duplicates == {"y": "x"} and ctx.documents_dropped == ["z"]
    assert ctx.dropped_messages == [1, 2]
    expected = prepare_chat(conv, llm.get_tokenizer(), documents=docs, top_k_documents=1, keep_last_turns=1)
    assert out[0].prompt_token_ids == expected.prompt_token_ids
    assert ctx.prompt_tokens_sent > len(out[0].prompt_token_ids)


def test_llm_chat_summarizes_the_dropped_turns_once(llm, monkeypatch):
    from leanserve.context import prepare_chat
    from leanserve.context.summary import summary_prompt

    conv = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "My name is Ada and I live in Lisbon."},
            {"role": "assistant", "content": "Nice to meet you, Ada!"},
            {"role": "user", "content": "Where do I live?"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    runs = []
    run = llm._run
    monkeypatch.setattr(llm, "_run", lambda prompts, *a: runs.append(prompts) or run(prompts, *a))
    out = llm.chat(conv, params, keep_last_turns=1, history_summary_tokens=8)
    (ctx,) = llm.last_chat_context
    assert (ctx.summary_status, ctx.summary_source, ctx.dropped_messages) == ("computed", [1, 2], [1, 2])
    assert len(runs) == 2  # the summary, then the chat
    ids = summary_prompt(conv[1:3], llm.get_tokenizer(), 10_000)
    text = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    expected = prepare_chat(conv, llm.get_tokenizer(), keep_last_turns=1, history_summary_tokens=8,
                            summary=text.strip())
    assert out[0].prompt_token_ids == expected.prompt_token_ids
    runs.clear()
    again = llm.chat(conv, params, keep_last_turns=1, history_summary_tokens=8)
    assert len(runs) == 1 and llm.last_chat_context[0].summary_status == "reused"  # only the chat ran
    assert again[0].prompt_token_ids == expected.prompt_token_ids
    failed = llm.chat(conv, params, keep_last_turns=1, history_summary_tokens=100_000)  # cannot run: plain
    assert llm.last_chat_context[0].summary_status == "failed"
    assert "ContextLengthExceededError" in llm.last_chat_context[0].summary_reason
    assert failed[0].prompt_token_ids == prepare_chat(conv, llm.get_tokenizer(), keep_last_turns=1).prompt_token_ids


TOOL_CONV = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": "What is the weather in Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [  # OpenAI's shape: no content beside the calls
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "3 C, light snow"},
             {"role": "assistant", "content": "It is 3 C with light snow in Oslo."},
             {"role": "user", "content": "And should I take an umbrella?"}]


def test_llm_chat_takes_an_assistant_message_with_content_none_and_tool_calls(llm):
    """As the server: the tool turns go through the hermes fallback (SmolLM2's template has no tools)."""
    from leanserve.structured.tools import render_messages

    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, temperature=0)
    out = llm.chat(TOOL_CONV, params)
    expected = tok.encode(tok.apply_chat_template(render_messages(TOOL_CONV, None)), add_special_tokens=False)
    assert out[0].prompt_token_ids == expected
    assert "get_weather" in tok.decode(expected)
    out = llm.chat(TOOL_CONV, params, keep_last_turns=1)  # the whole tool turn is dropped together
    assert llm.last_chat_context[0].dropped_messages == [1, 2, 3, 4]


def test_llm_chat_takes_tool_arguments_as_an_object_too(llm):
    """Hugging Face's form (``arguments`` a dict) renders as OpenAI's (the JSON text of the same object)."""
    import copy
    import json

    as_dict = copy.deepcopy(TOOL_CONV)
    for m in as_dict:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    params = SamplingParams(max_tokens=1, temperature=0)
    assert llm.chat(as_dict, params)[0].prompt_token_ids == llm.chat(TOOL_CONV, params)[0].prompt_token_ids


def test_trim_history_takes_an_assistant_message_with_content_none(llm):
    from leanserve.context import count_tokens, trim_history

    tok = llm.get_tokenizer()
    empty = [{**m, "content": ""} if m["content"] is None else m for m in TOOL_CONV]
    full = count_tokens(tok, empty)
    trimmed = trim_history(TOOL_CONV, tok, max_prompt_tokens=full - 1)
    assert trimmed.num_tokens_sent == full and trimmed.dropped == [1, 2, 3, 4]
    assert trimmed.messages[0] is TOOL_CONV[0] and trimmed.messages[-1] is TOOL_CONV[-1]
