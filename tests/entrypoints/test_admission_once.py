"""A request's parameters are checked once, by the engine's admission, whichever entry point sent it: the Python
API (``LLM``), HTTP chat and HTTP completions refuse the same bad request with the same message."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.engine.admission import RequestAdmission
from leanserve.errors import ContextLengthExceededError, InvalidParameterError

import pytest
from conftest import SERVER_MAX_MODEL_LEN

MSGS = [{"role": "user", "content": "Name three rivers."}]
PROMPT_IDS = [1, 504, 3458, 28, 216, 7]  # any ids in the vocabulary


@pytest.fixture(scope="module")
def llm_like_server(loaded):
    """An LLM with the shared server's context (the admission settings that matter here)."""
    return LLM(loaded=loaded, max_model_len=SERVER_MAX_MODEL_LEN, kv_cache_memory=64 << 20)


def count_admissions(monkeypatch) -> list[int]:
    calls = []
    original = RequestAdmission.admit

    def spy(self, prompt, params):
        calls.append(1)
        return original(self, prompt, params)

    monkeypatch.setattr(RequestAdmission, "admit", spy)
    return calls


def http_error(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_max_tokens_beyond_the_context_one_message_everywhere(llm_like_server, client, monkeypatch):
    too_many = SERVER_MAX_MODEL_LEN  # prompt + this > the context
    calls = count_admissions(monkeypatch)
    with pytest.raises(ContextLengthExceededError) as chat_exc:
        llm_like_server.chat(MSGS, SamplingParams(max_tokens=too_many))
    with pytest.raises(ContextLengthExceededError) as gen_exc:
        llm_like_server.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=too_many))
    assert len(calls) == 2  # one admission per request, nothing else checked the length
    assert f"{len(PROMPT_IDS)} in the prompt, {too_many} for the completion" in str(gen_exc.value)

    chat = http_error(client, "/v1/chat/completions", {"messages": MSGS, "max_tokens": too_many})
    assert chat["message"] == str(chat_exc.value)
    assert (chat["param"], chat["code"]) == ("max_tokens", "context_length_exceeded")
    cmpl = http_error(client, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": too_many})
    assert cmpl["message"] == str(gen_exc.value)
    assert (cmpl["param"], cmpl["code"]) == ("max_tokens", "context_length_exceeded")


def test_max_tokens_zero_one_message_everywhere(client):
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(max_tokens=0)
    assert exc.value.param == "max_tokens"
    chat = http_error(client, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 0})
    cmpl = http_error(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    assert chat["message"] == cmpl["message"] == str(exc.value)
    assert chat["param"] == cmpl["param"] == "max_tokens"
    renamed = http_error(client, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 0})
    assert renamed["param"] == "max_completion_tokens"
    assert renamed["message"] == str(exc.value).replace("max_tokens", "max_completion_tokens", 1)


def test_prompt_beyond_the_context_one_message_everywhere(llm_like_server, client):
    long_ids = PROMPT_IDS * (SERVER_MAX_MODEL_LEN // len(PROMPT_IDS) + 1)
    with pytest.raises(ContextLengthExceededError) as exc:
        llm_like_server.generate({"prompt_token_ids": long_ids}, SamplingParams(max_tokens=1))
    cmpl = http_error(client, "/v1/completions", {"prompt": long_ids, "max_tokens": 1})
    assert cmpl["message"] == str(exc.value) and cmpl["param"] == "prompt"
    assert llm_like_server.engine.scheduler.requests == {}  # nothing was queued


def test_echo_without_generation_is_checked_like_any_request(client):
    """``echo`` with ``max_tokens: 0`` generates nothing, but its parameters and prompt are still checked."""
    base = {"prompt": "Hi there", "echo": True, "max_tokens": 0}
    for extra, param in (({"n": 0}, "n"), ({"n": 1000}, "n"), ({"temperature": -1}, "temperature")):
        assert http_error(client, "/v1/completions", {**base, **extra})["param"] == param
    long_ids = PROMPT_IDS * (SERVER_MAX_MODEL_LEN // len(PROMPT_IDS) + 1)
    err = http_error(client, "/v1/completions", {"prompt": long_ids, "echo": True, "max_tokens": 0})
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    r = client.post("/v1/completions", json={**base, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["Hi there", "Hi there"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 0


def test_errors_speak_the_field_the_client_sent(client):
    err = http_error(client, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 10**6})
    assert err["param"] == "max_completion_tokens" and "max_tokens" not in err["message"]
    err = http_error(client, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 2, "min_tokens": 5})
    assert err["param"] == "min_tokens" and "max_completion_tokens (2)" in err["message"]


def test_a_request_larger_than_the_waiting_queue_is_a_400_not_a_retry(client):
    # the shared server queues 1024 sequences: 9 prompts x n=128 can never be queued whole
    err = http_error(client, "/v1/completions", {"prompt": ["a"] * 9, "max_tokens": 1, "n": 128})
    assert err["param"] == "n" and "--max-waiting" in err["message"]


def test_raw_surrogate_bytes_are_a_400(client):
    body = b'{"model": "\xed\xa0\x80", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200  # the connection still serves


def test_a_huge_text_prompt_is_refused_before_tokenizing(llm_like_server, client, monkeypatch):
    huge = "word " * 400_000  # 2 MB of text: tokenizing it would take seconds
    tokenizer = llm_like_server.engine.tokenizer
    calls = []
    original = type(tokenizer).encode
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with pytest.raises(ContextLengthExceededError, match="at least") as exc:
        llm_like_server.generate(huge, SamplingParams(max_tokens=1))
    assert calls == [] and exc.value.param == "prompt"
    assert f"at least {tokenizer.min_num_tokens(huge)} tokens" in str(exc.value)
    for path, body in [("/v1/completions", {"prompt": huge, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": ["hi", huge]}),
                       ("/v1/completions", {"prompt": huge, "echo": True, "max_tokens": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})]:
        err = http_error(client, path, body)
        assert (err["param"], err["code"]) == ("prompt" if "prompt" in body else "messages",
                                               "context_length_exceeded"), (path, err)
    assert llm_like_server.engine.scheduler.requests == {}


def test_a_long_prompt_being_tokenized_does_not_stall_the_server(server):
    """A prompt that must be tokenized whole (``truncate_prompt_tokens`` keeps its end) is tokenized off the
    event loop with the GIL released: /health answers meanwhile, in a small part of the request's time."""
    import threading
    import time

    big = {"prompt": "word " * 1_000_000, "max_tokens": 1, "truncate_prompt_tokens": 8}
    result = {}

    def send():
        t0 = time.monotonic()
        with server.client(timeout=120) as c:
            result["status"] = c.post("/v1/completions", json=big).status_code
        result["elapsed"] = time.monotonic() - t0

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the 5 MB body is uploaded and being tokenized
    with server.client(timeout=120) as c:
        t0 = time.monotonic()
        health = c.get("/health").status_code
        health_s = time.monotonic() - t0
    sender.join()
    assert result["status"] == 200 and health == 200
    assert result["elapsed"] > 1.0 and health_s < result["elapsed"] / 4, (health_s, result)


@pytest.mark.parametrize("messages, where", [
    ("hello", "got str"),
    ([], "(empty)"),
    ([{"content": "x"}], "messages.0.role"),
    ([{"role": "user"}], "a user message needs content"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content.0"),
    ([MSGS[0], {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages.1.tool_calls.0"),
    ([MSGS[0], "hi"], "messages.1: a message is a dict"),
    ([MSGS, []], "messages.1 must be a non-empty list"),
])
def test_llm_chat_checks_messages_as_the_server_does(llm_like_server, client, messages, where):
    with pytest.raises(InvalidParameterError, match=where) as info:
        llm_like_server.chat(messages, use_tqdm=False)
    assert info.value.param == "messages"
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):  # the server refuses it too
        assert http_error(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert not llm_like_server.engine.has_unfinished_requests()


def test_llm_chat_takes_the_messages_vllm_takes(llm_like_server):
    """As vLLM's ``LLM.chat``: any role name, a tool result without ``tool_call_id``, a call without ``id``, a
    tuple; a call's arguments as an object render as its JSON text does."""
    def conv(arguments):
        call = {"type": "function", "function": {"name": "get_time", "arguments": arguments}}
        return (MSGS[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "name": "get_time", "content": "12:00"}, {"role": "ipython", "content": "ok"})

    params = SamplingParams(max_tokens=1)
    as_object, as_text = llm_like_server.chat([conv({"tz": "UTC"}), conv('{"tz": "UTC"}')], params, use_tqdm=False)
    assert as_object.prompt_token_ids == as_text.prompt_token_ids
    prompt = llm_like_server.engine.tokenizer.decode(as_object.prompt_token_ids, skip_special_tokens=False)
    assert '"arguments": {"tz": "UTC"}' in prompt and "<tool_response>\n12:00" in prompt
    assert "<|im_start|>ipython\nok" in prompt


def test_llm_chat_renders_developer_and_text_parts_as_the_server_does(llm_like_server):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    params = SamplingParams(max_tokens=1)
    a, b = llm_like_server.chat([plain, parts], params, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids


@pytest.mark.parametrize("bad", [{"max_tokens": 2}, [{"max_tokens": 2}], "greedy"])
def test_generate_refuses_sampling_params_that_are_not_sampling_params(llm_like_server, bad):
    with pytest.raises(InvalidParameterError, match="must be a SamplingParams") as info:
        llm_like_server.generate(["hi"], bad, use_tqdm=False)
    assert info.value.param == "sampling_params"


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head_on_health_and_metrics(client, path):
    get, head = client.get(path), client.head(path)
    assert get.status_code == head.status_code == 200 and head.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")
