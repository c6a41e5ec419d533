"""The context policies and the answer cache through a real server (one per module; semantic answer cache, which
includes the exact one; two API keys)."""

from __future__ import annotations

import pytest
from server_helpers import ServerProcess, sse_chunks

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OTHER_KEY = "other-key"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--kv-cache-memory", str(256 << 20), "--max-model-len", "2048", "--answer-cache", "semantic",
                         "--api-key", OTHER_KEY]).start()
    yield srv
    assert srv.stop() == 0, srv.stderr()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _bad(r, param=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------------------ truncation
def test_truncate_prompt_tokens_on_both_endpoints(client):
    msgs = [{"role": "user", "content": "Count with me: one two three four five six seven eight nine ten."}]
    full = _ok(client.post(CHAT, json={"messages": msgs, "max_tokens": 2, "temperature": 0, "cache": False}))
    cut = _ok(client.post(CHAT, json={"messages": msgs, "max_tokens": 2, "temperature": 0, "cache": False,
                                      "truncate_prompt_tokens": 8}))
    sent = full["usage"]["prompt_tokens"]
    assert full["usage"]["leanserve"]["truncated_tokens"] == 0 and full["usage"]["leanserve"]["cache"] == "bypass"
    assert cut["usage"]["prompt_tokens"] == 8
    rep = cut["usage"]["leanserve"]
    assert rep["prompt_tokens_sent"] == sent and rep["truncated_tokens"] == sent - 8 and rep["cache"] == "bypass"
    text = "alpha beta gamma delta " * 700  # ~2,800 tokens: over the 2,048 context
    c = _ok(client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 4, "truncate_prompt_tokens": -1,
                                           "temperature": 0, "cache": False}))
    assert c["usage"]["prompt_tokens"] == 2048 - 4
    assert c["usage"]["leanserve"]["truncated_tokens"] == c["usage"]["leanserve"]["prompt_tokens_sent"] - 2044
    _bad(client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 4}))  # without it: too long, a 400


@pytest.mark.parametrize("body, message", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 (the model's limit) or an integer >= 1, got 0"),
    ({"truncate_prompt_tokens": -2}, "must be -1 (the model's limit) or an integer >= 1, got -2"),
    ({"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens (4096) must be at most the model's context length "
     "(2048)"),
    ({"max_prompt_tokens": -1}, "max_prompt_tokens: Input should be greater than or equal to 1"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens: Input should be greater than or equal to 1"),
    ({"keep_last_turns": 0}, "keep_last_turns: Input should be greater than or equal to 1"),
    ({"max_context_tokens": -5}, "max_context_tokens: Input should be greater than or equal to 1"),
    ({"top_k_documents": 0}, "top_k_documents: Input should be greater than or equal to 1"),
    ({"documents": "not a list"}, "documents: Input should be a valid list"),
    ({"documents": {"id": "a", "text": "b"}}, "documents: Input should be a valid list"),
    ({"documents": [{"text": "no id"}]}, "documents.0.id: Field required"),
    ({"documents": [{"id": "a"}]}, "documents.0.text: Field required"),
    ({"documents": [{"id": 1, "text": "x"}]}, "documents.0.id: Input should be a valid string"),
    ({"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]},
     "document ids must be unique; 'a' appears twice"),
    ({"max_prompt_tokens": 5},  # the system prompt and the question alone are longer
     "the system/developer messages and the latest user turn alone have 24 tokens, over max_prompt_tokens=5"),
    ({"documents": [{"id": str(i), "text": "x"} for i in range(257)]},
     "documents: at most 256 documents are allowed, got 257"),
    ({"documents": [{"id": "a", "text": ""}]}, "documents.0.text: a document's text must not be empty or whitespace"),
    ({"documents": [{"id": "a", "text": " \n\t "}]}, "documents.0.text: a document's text must not be empty"),
    ({"documents": [{"id": "", "text": "x"}]}, "documents.0.id: String should have at least 1 character"),
    ({"reorder_documents": "yes"}, "reorder_documents: Input should be a valid boolean"),
    ({"reorder_documents": 1}, "reorder_documents: Input should be a valid boolean"),
    ({"history_summary_tokens": 8}, "history_summary_tokens summarizes the turns that max_prompt_tokens or "
     "keep_last_turns drop"),
])
def test_bad_values_are_400s(client, body, message):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of Peru?"}]
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", next(iter(body)))
    assert message in err["message"]
    assert client.post(CHAT, json={"messages": msgs, "max_tokens": 1, "cache": False}).status_code == 200


def test_null_cache_and_null_documents_are_absent(client):
    msgs = [{"role": "user", "content": "Name one ocean."}]
    base = {"messages": msgs, "max_tokens": 2, "temperature": 0}
    plain = client.post(CHAT, json=base)
    for extra in ({"cache": None}, {"documents": None}, {"cache": None, "documents": None}):
        r = client.post(CHAT, json={**base, **extra})
        assert r.status_code == 200 and r.headers["x-leanserve-cache"] == "hit", (extra, r.text)  # as absent
        assert r.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("body", [{"documents": [{"id": "a", "text": "Lima is the capital of Peru."}]},
                                  {"documents": []}, {"max_context_tokens": 100}, {"top_k_documents": 2},
                                  {"max_prompt_tokens": 100}, {"keep_last_turns": 1}, {"history_summary_tokens": 8},
                                  {"reorder_documents": False}, {"reorder_documents": "yes"}])
def test_chat_only_context_fields_on_completions_are_400s_naming_the_field(client, body):
    r = client.post(COMPLETIONS, json={"prompt": "The capital of Peru is", "max_tokens": 1, **body})
    field = next(iter(body))
    err = _bad(r, field)
    hint = "cut the prompt with truncate_prompt_tokens" if field in ("max_prompt_tokens", "keep_last_turns",
                                                                       "history_summary_tokens") \
        else "put the passages in the prompt"
    assert err["message"] == f"{field}: {field} is only supported on /v1/chat/completions (it needs messages); " \
        f"on /v1/completions {hint}"
    assert client.post(COMPLETIONS, json={"prompt": "The capital of Peru is", "max_tokens": 1, "cache": False,
                                          **{field: None}}).status_code == 200  # null is the default: accepted


# --------------------------------------------------------------------------------------------------- history
def conversation(turns: int, extra: int = 0) -> list[dict]:
    conv = [{"role": "system", "content": "You are a patient travel agent. Answer in one short sentence."}]
    for i in range(turns + extra):
        conv.append({"role": "user", "content": f"Question {i}: what is a good thing to see in city number {i}, "
                     "and how long should I stay there if I like museums and parks?"})
        if i < turns + extra - 1:
            conv.append({"role": "assistant", "content": f"In city {i}, visit the old town and its museum; two "
                         "days are enough for the museums and one more for the parks."})
    return conv


def test_40_turns_under_1024_tokens_then_the_next_turn_hits_the_prefix_cache(client):
    conv = conversation(40)
    body = {"messages": conv, "max_tokens": 4, "temperature": 0, "max_prompt_tokens": 1024, "cache": False}
    first = _ok(client.post(CHAT, json=body))
    rep = first["usage"]["leanserve"]
    dropped = rep["dropped_messages"]
    assert first["usage"]["prompt_tokens"] <= 1024 < rep["prompt_tokens_sent"]
    assert 0 not in dropped and len(conv) - 1 not in dropped
    assert dropped == list(range(1, len(dropped) + 1))  # the oldest turns, whole: user + assistant pairs
    assert len(dropped) % 2 == 0 and len(dropped) > 20
    tok = _ok(client.post("/tokenize", json={"messages": [conv[0]] + conv[len(dropped) + 1:]}))
    assert tok["count"] == first["usage"]["prompt_tokens"]  # what was computed is exactly the kept messages

    nxt = conv + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "Thanks! And what about the food there?"}]
    second = _ok(client.post(CHAT, json={**body, "messages": nxt}))
    assert second["usage"]["leanserve"]["dropped_messages"] == dropped  # the same cut: a byte-stable prefix
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 16  # all of the previous prompt but its last block


def test_keep_last_turns(client):
    conv = conversation(5)
    r = _ok(client.post(CHAT, json={"messages": conv, "max_tokens": 2, "keep_last_turns": 2, "cache": False}))
    # turns [1, 2], [3, 4], [5, 6], [7, 8] before the latest user turn (9): the last of them stays
    assert r["usage"]["leanserve"]["dropped_messages"] == list(range(1, 7))


# -------------------------------------------------------------------------------------- summary of dropped turns
def _summary_reference(client, dropped_msgs: list[dict], n: int) -> str:
    """The summary computed independently: the same summarization chat, tokenized and completed greedily over
    /v1/completions."""
    from leanserve.context.summary import summary_request_messages

    ids = _ok(client.post("/tokenize", json={"messages": summary_request_messages(dropped_msgs)}))["tokens"]
    out = _ok(client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": n, "temperature": 0, "cache": False}))
    return out["choices"][0]["text"].strip()


def test_dropped_turns_are_summarized_once_then_reused_and_the_prefix_cache_hits(server, client):
    from leanserve.context.summary import summary_message

    conv = conversation(40)
    body = {"messages": conv, "max_tokens": 4, "temperature": 0, "max_prompt_tokens": 1024, "cache": False,
            "history_summary_tokens": 32}
    before = server.metrics()
    first = _ok(client.post(CHAT, json=body))
    after = server.metrics()
    rep = first["usage"]["leanserve"]
    dropped, summ = rep["dropped_messages"], rep["history_summary"]
    assert summ["status"] == "computed" and summ["role"] == "system" and summ["replaces"] == dropped
    assert dropped == list(range(1, len(dropped) + 1)) and len(dropped) % 2 == 0
    assert summ["prompt_tokens"] > 0 and 1 <= summ["completion_tokens"] <= 32
    assert first["usage"]["prompt_tokens"] <= 1024
    # the internal request is no client request, but its tokens were computed
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        first["usage"]["completion_tokens"] + summ["completion_tokens"]
    # what the model saw: the system prompt, the summary message, the kept turns (checked against a reference)
    text = _summary_reference(client, conv[1:len(dropped) + 1], 32)
    kept = [conv[0], summary_message(text)] + conv[len(dropped) + 1:]
    assert _ok(client.post("/tokenize", json={"messages": kept}))["count"] == first["usage"]["prompt_tokens"]

    nxt = conv + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "Thanks! And what about the food there?"}]
    before = server.metrics()
    second = _ok(client.post(CHAT, json={**body, "messages": nxt}))
    after = server.metrics()
    rep2 = second["usage"]["leanserve"]
    assert rep2["dropped_messages"] == dropped  # the same cut, the same summary: a byte-stable prefix
    assert rep2["history_summary"] == {**summ, "status": "reused", "prompt_tokens": 0, "completion_tokens": 0}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        second["usage"]["completion_tokens"]  # no second internal request
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16


def test_health_answers_while_a_huge_history_is_trimmed_and_summarized(server, client):
    """2,400 turns (~300 KB) under a 1,000-token budget with a summary: its policies and summary prompt are
    prepared off the event loop, so /health keeps answering meanwhile (it took 75 s when they ran on it)."""
    import threading
    import time

    import httpx

    conv = conversation(1200)
    body = {"messages": conv, "max_tokens": 2, "temperature": 0, "max_prompt_tokens": 1000, "cache": False,
            "history_summary_tokens": 16}
    result = {}

    def run():
        result["r"] = client.post(CHAT, json=body, timeout=300)

    t = threading.Thread(target=run)
    start = time.monotonic()
    t.start()
    waits = []
    with httpx.Client(base_url=server.url, timeout=60) as probe:
        while t.is_alive():
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
    t.join()
    rep = _ok(result["r"])["usage"]["leanserve"]
    assert rep["history_summary"]["status"] == "computed" and len(rep["dropped_messages"]) > 2000
    assert len(waits) >= 3 and max(waits) < 1.0, (max(waits), time.monotonic() - start)


def test_summary_that_cannot_fit_or_fails_falls_back_to_plain_dropping(client):
    conv = conversation(8)
    plain = _ok(client.post(CHAT, json={"messages": conv, "max_tokens": 2, "keep_last_turns": 2, "cache": False}))
    # a summary budget beyond the model's context: its request cannot be admitted; the client's still answers
    failed = _ok(client.post(CHAT, json={"messages": conv, "max_tokens": 2, "keep_last_turns": 2, "cache": False,
                                         "history_summary_tokens": 2040}))
    rep = failed["usage"]["leanserve"]
    assert rep["history_summary"]["status"] == "failed" and rep["history_summary"]["reason"]
    assert rep["history_summary"]["replaces"] == rep["dropped_messages"] == plain["usage"]["leanserve"][
        "dropped_messages"]
    assert failed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # room for the summary (1000 tokens) would leave less than the system prompt and the question: skipped
    skipped = _ok(client.post(CHAT, json={"messages": conv, "max_tokens": 2, "max_prompt_tokens": 200,
                                          "cache": False, "history_summary_tokens": 1000}))
    rep = skipped["usage"]["leanserve"]
    assert rep["history_summary"]["status"] == "skipped" and "does not fit" in rep["history_summary"]["reason"]
    assert rep["history_summary"]["prompt_tokens"] == 0 and skipped["usage"]["prompt_tokens"] <= 200
    off = _ok(client.post(CHAT, json={"messages": conv, "max_tokens": 2, "max_prompt_tokens": 200,
                                      "cache": False, "history_summary_tokens": 0}))
    assert "history_summary" not in off["usage"]["leanserve"] or off["usage"]["leanserve"]["history_summary"] is None
    assert off["usage"]["prompt_tokens"] == skipped["usage"]["prompt_tokens"]
    # a budget no summary can have (the model's whole context): a 400 naming the field
    r = client.post(CHAT, json={"messages": conv, "max_tokens": 2, "keep_last_turns": 2,
                                "history_summary_tokens": 2048})
    assert r.status_code == 400 and r.json()["error"]["param"] == "history_summary_tokens", r.text


# ------------------------------------------------------------------------------------------------- passages
FACTS = [("a", "The Amazon river flows through Brazil and Peru into the Atlantic Ocean."),
         ("b", "Mount Kilimanjaro in Tanzania is the highest mountain in Africa."),
         ("c", "The Great Barrier Reef lies off the coast of Queensland in Australia."),
         ("d", "Lake Baikal in Siberia is the deepest lake in the world."),
         ("e", "The Sahara is the largest hot desert and covers much of North Africa."),
         ("f", "Angel Falls in Venezuela is the tallest uninterrupted waterfall on Earth."),
         ("g", "The Dead Sea between Jordan and Israel is the lowest point on land."),
         ("h", "The Mariana Trench in the Pacific Ocean is the deepest part of the oceans.")]


def passages12() -> list[dict]:
    docs = [{"id": i, "text": t} for i, t in FACTS]
    # four near-duplicates of b, d, f, h: one word changed or added, as a retriever returns from two sources
    docs += [{"id": "b2", "text": "Mount Kilimanjaro in Tanzania is the highest mountain of Africa."},
             {"id": "d2", "text": "Lake Baikal in Siberia is the deepest lake in the whole world."},
             {"id": "f2", "text": "Angel Falls in Venezuela is the tallest uninterrupted waterfall on the Earth."},
             {"id": "h2", "text": "The Mariana Trench in the Pacific Ocean is the deepest part of all oceans."}]
    return docs


def test_12_passages_4_near_duplicates(client):
    q = [{"role": "user", "content": "Which lake is the deepest in the world?"}]
    r = _ok(client.post(CHAT, json={"messages": q, "documents": passages12(), "top_k_documents": 3,
                                    "max_tokens": 12, "temperature": 0, "cache": False}))
    rep = r["usage"]["leanserve"]
    assert {d["id"]: d["duplicate_of"] for d in rep["documents_duplicates"]} == \
        {"b2": "b", "d2": "d", "f2": "f", "h2": "h"}
    assert rep["documents_used"][0] == "d" and len(rep["documents_used"]) == 3
    assert len(rep["documents_dropped"]) == 8 - 3
    assert rep["prompt_tokens_sent"] > r["usage"]["prompt_tokens"]
    # a token budget: the kept passages fit it
    b = _ok(client.post(CHAT, json={"messages": q, "documents": passages12(), "max_context_tokens": 40,
                                    "max_tokens": 2, "cache": False}))
    assert b["usage"]["leanserve"]["documents_used"][0] == "d" and len(b["usage"]["leanserve"]["documents_used"]) <= 3


def test_max_prompt_tokens_keeps_the_passages_that_fit(client):
    q = [{"role": "system", "content": "Answer from the documents."},
         {"role": "user", "content": "How deep is lake number 3?"}]
    docs = [{"id": str(i), "text": f"Lake number {i} is {i * 10 + 7} meters deep. " + "Its shores are calm. " * 30}
            for i in range(8)]  # ~1,500 tokens in all
    r = _ok(client.post(CHAT, json={"messages": q, "documents": docs, "max_prompt_tokens": 400, "max_tokens": 1,
                                    "cache": False}))
    rep = r["usage"]["leanserve"]
    assert r["usage"]["prompt_tokens"] <= 400 and rep["prompt_tokens_sent"] > 1000
    assert rep["documents_used"][0] == "3" and 1 <= len(rep["documents_used"]) < 8
    assert sorted(rep["documents_used"] + rep["documents_dropped"]) == [str(i) for i in range(8)]


def test_documents_with_truncate_prompt_tokens_are_a_400(client):
    """A left cut would hide documents from the model while documents_used still listed them: refused."""
    q = [{"role": "user", "content": "Which lake is the deepest?"}]
    docs = [{"id": str(i), "text": f"Lake number {i} is {i * 10} meters deep."} for i in range(5)]
    err = _bad(client.post(CHAT, json={"messages": q, "documents": docs, "truncate_prompt_tokens": 50,
                                       "max_tokens": 1}), "truncate_prompt_tokens")
    assert "max_context_tokens" in err["message"]
    _ok(client.post(CHAT, json={"messages": q, "documents": [], "truncate_prompt_tokens": 50, "max_tokens": 1,
                                "cache": False}))  # no documents: nothing hidden


# --------------------------------------------------------------------------------------------- answer cache
def test_repeated_deterministic_request_is_served_from_the_cache(server, client):
    body = {"messages": [{"role": "user", "content": "Name three colors of the rainbow."}], "max_tokens": 12,
            "temperature": 0}
    m0 = server.metrics()
    r1 = client.post(CHAT, json=body)
    r2 = client.post(CHAT, json=body)
    assert r1.headers["x-leanserve-cache"] == "miss" and r2.headers["x-leanserve-cache"] == "hit"
    a, b = _ok(r1), _ok(r2)
    assert a["choices"] == b["choices"]
    assert {k: v for k, v in a["usage"].items() if k != "leanserve"} == \
        {k: v for k, v in b["usage"].items() if k != "leanserve"}
    assert a["usage"]["leanserve"]["cache"] == "miss" and b["usage"]["leanserve"]["cache"] == "hit"
    assert b["usage"]["leanserve"]["prompt_tokens_computed"] == 0
    assert b["timings"]["ttft_ms"] < 10.0
    m1 = server.metrics()
    assert m1["leanserve:answer_cache_queries_total"] - m0.get("leanserve:answer_cache_queries_total", 0) == 2
    hits = f'leanserve:answer_cache_hits_total{{kind="exact",model_name="{server.model}"}}'
    assert m1[hits] - m0.get(hits, 0) == 1
    # one answer more in the cache, and its bytes (within the bound the server was started with)
    assert m1["leanserve:answer_cache_entries"] - m0["leanserve:answer_cache_entries"] == 1
    assert m1["leanserve:answer_cache_bytes"] > m0["leanserve:answer_cache_bytes"]
    # the engine never saw the hit
    assert m1["vllm:request_success_total"] - m0["vllm:request_success_total"] == 1


def test_a_replayed_stream_keeps_chunks_finish_reason_and_usage(client):
    body = {"messages": [{"role": "user", "content": "Write a haiku about rain."}], "max_tokens": 10, "seed": 7,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}
    r1 = client.post(CHAT, json=body)
    r2 = client.post(CHAT, json=body)
    assert (r1.headers["x-leanserve-cache"], r2.headers["x-leanserve-cache"]) == ("miss", "hit")
    c1, c2 = sse_chunks(r1.text), sse_chunks(r2.text)

    def shape(chunks):
        return [([{k: v for k, v in ch.items()} for ch in c["choices"]],
                 {k: v for k, v in (c["usage"] or {}).items() if k != "leanserve"}) for c in chunks]

    assert shape(c1) == shape(c2) and len(c1) >= 4
    assert c2[-1]["usage"]["leanserve"]["cache"] == "hit"
    assert c1[-2]["choices"][0]["finish_reason"] == c2[-2]["choices"][0]["finish_reason"] == "length"
    # the non-streaming form of the same request is the same answer, from the same entry
    whole = client.post(CHAT, json={**body, "stream": False, "stream_options": None})
    assert whole.headers["x-leanserve-cache"] == "hit"
    assert whole.json()["choices"][0]["message"]["content"] == "".join(
        ch["delta"].get("content", "") for c in c1 for ch in c["choices"])


@pytest.mark.parametrize("change", [
    {"max_tokens": 7}, {"stop": ["blue"]}, {"seed": 3}, {"logprobs": True, "top_logprobs": 1},
    {"temperature": 0.5, "seed": 1}, {"top_p": 0.5}, {"presence_penalty": 0.5}, {"min_tokens": 2},
    {"messages": [{"role": "system", "content": "Be terse."},
                  {"role": "user", "content": "Name two primary colors."}]},
])
def test_any_change_misses(client, change):
    base = {"messages": [{"role": "user", "content": "Name two primary colors."}], "max_tokens": 6,
            "temperature": 0}
    client.post(CHAT, json=base)
    assert client.post(CHAT, json=base).headers["x-leanserve-cache"] == "hit"
    assert client.post(CHAT, json={**base, **change}).headers["x-leanserve-cache"] == "miss"


def test_other_api_key_misses_and_sampling_without_seed_is_never_cached(server, client):
    body = {"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 5, "temperature": 0}
    client.post(CHAT, json=body)
    assert client.post(CHAT, json=body).headers["x-leanserve-cache"] == "hit"
    other = client.post(CHAT, json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"})
    assert other.headers["x-leanserve-cache"] == "miss"
    sampled = {**body, "temperature": 0.9}
    for _ in range(2):
        r = client.post(CHAT, json=sampled)
        assert "x-leanserve-cache" not in r.headers and r.json()["usage"]["leanserve"]["cache"] == "bypass"
    off = client.post(CHAT, json={**body, "cache": False})
    assert "x-leanserve-cache" not in off.headers and off.json()["usage"]["leanserve"]["cache"] == "bypass"


def test_completions_are_cached_too(client):
    body = {"prompt": "The capital of Italy is", "max_tokens": 4, "temperature": 0}
    a, b = client.post(COMPLETIONS, json=body), client.post(COMPLETIONS, json=body)
    assert (a.headers["x-leanserve-cache"], b.headers["x-leanserve-cache"]) == ("miss", "hit")
    assert a.json()["choices"] == b.json()["choices"]


def test_a_completions_batch_with_a_hit_reports_only_what_was_computed(client):
    a = "The largest planet of the solar system is"
    first = _ok(client.post(COMPLETIONS, json={"prompt": a, "max_tokens": 3, "temperature": 0}))
    n_a = first["usage"]["prompt_tokens"]
    batch = client.post(COMPLETIONS, json={"prompt": [a, "A batch's second prompt, never seen before, is"],
                                           "max_tokens": 3, "temperature": 0})
    assert batch.headers["x-leanserve-cache"] == "miss"  # not all of it hit
    usage = _ok(batch)["usage"]
    cached_b = usage["prompt_tokens_details"]["cached_tokens"] - first["usage"]["prompt_tokens_details"][
        "cached_tokens"]  # the hit reports the cached tokens of its first run
    assert usage["leanserve"]["prompt_tokens_computed"] == usage["prompt_tokens"] - n_a - cached_b


def test_semantic_cache_hits_a_paraphrase_not_a_near_miss(server, client):
    def ask(question, **kw):
        body = {"messages": [{"role": "system", "content": "You answer for the help desk."},
                             {"role": "user", "content": question}], "max_tokens": 6, "temperature": 0, **kw}
        return client.post(CHAT, json=body)

    m0 = server.metrics()
    first = ask("How do I reset my password?")
    assert first.headers["x-leanserve-cache"] == "miss"
    para = ask("How can I reset my password?")
    assert para.headers["x-leanserve-cache"] == "hit"
    assert para.json()["choices"] == first.json()["choices"]
    assert ask("How do I reset my router?").headers["x-leanserve-cache"] == "miss"  # another object
    assert ask("How can I not reset my password?").headers["x-leanserve-cache"] == "miss"  # a negation
    assert ask("How can I reset my password?", max_tokens=5).headers["x-leanserve-cache"] == "miss"  # parameters
    semantic = f'leanserve:answer_cache_hits_total{{kind="semantic",model_name="{server.model}"}}'
    assert server.metrics()[semantic] - m0.get(semantic, 0) == 1


def test_identical_requests_at_once_run_once(server):
    """Coalescing: four identical deterministic requests sent together: one runs, three wait for its answer."""
    import asyncio

    body = {"messages": [{"role": "user", "content": "List four kinds of trees."}], "max_tokens": 16,
            "temperature": 0}

    async def burst():
        async with server.async_client() as c:
            return await asyncio.gather(*(c.post(CHAT, json=body) for _ in range(4)))

    m0 = server.metrics()
    rs = asyncio.run(burst())
    assert sorted(r.headers["x-leanserve-cache"] for r in rs) == ["hit", "hit", "hit", "miss"]
    assert len({str(r.json()["choices"]) for r in rs}) == 1
    m1 = server.metrics()
    assert m1["vllm:request_success_total"] - m0["vllm:request_success_total"] == 1


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "prompt logprobs and the cache"}],
                              "prompt_logprobs": 0}),
    ("/v1/completions", {"prompt": "prompt logprobs and the cache", "echo": True, "logprobs": 1}),
])
def test_prompt_logprobs_bypass_the_cache(client, path, extra):
    """The cache replays generated tokens only: a request for prompt logprobs runs each time, and keeps them."""
    body = {"max_tokens": 2, "temperature": 0, **extra}
    first, second = (client.post(path, json=body) for _ in range(2))
    assert first.status_code == second.status_code == 200
    assert "x-leanserve-cache" not in second.headers
    assert second.json()["usage"]["leanserve"]["cache"] == "bypass"
    if "prompt_logprobs" in extra:
        assert second.json()["prompt_logprobs"] == first.json()["prompt_logprobs"] is not None
    else:
        lp = second.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["text_offset"][0] == 0
