"""Tool calling with the OpenAI SDK and LangChain on the shared server (hermes format; SmolLM2's template has no
tools, so the fallback system-prompt section lists them).

Streaming and not: a single named call, parallel calls under ``required``, ``parallel_tool_calls: false``, a tool
without parameters (``"{}"``), ``tool_choice: "none"`` (the output of the same request without tools), a
multi-turn exchange with tool results; each streamed call assembled by the SDK equals the non-streamed one, and
every call's arguments validate against its tool's schema. LangChain's ``bind_tools`` loop completes a two-step
task. Bad tool fields are 400s naming the field. The parser alone: any split of the text gives the same calls.
"""

from __future__ import annotations

import itertools
import json

from leanserve.structured.tools import ToolCallParser, render_messages

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "maxProperties": 0}}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def both(sdk, server, messages=ASK, max_tokens=120, **kwargs):
    """(non-streamed choice, streamed choice assembled by the SDK) of the same greedy request."""
    args = dict(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    whole = sdk.chat.completions.create(**args).choices[0]
    try:
        with sdk.chat.completions.stream(**args) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion().choices[0]
    except openai.LengthFinishReasonError as exc:  # the SDK's stream helper refuses a "length" ending
        final = exc.completion.choices[0]
    return whole, final


def calls_of(choice) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def check_calls(whole, streamed, names: set[str]) -> list[tuple[str, str]]:
    calls = calls_of(whole)
    assert calls and calls == calls_of(streamed)
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert whole.message.content is None
    ids = [c.id for c in whole.message.tool_calls] + [c.id for c in streamed.message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return calls


def test_named_function(sdk, server):
    whole, streamed = both(sdk, server, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = check_calls(whole, streamed, {"get_weather"})
    assert len(calls) == 1 and json.loads(calls[0][1])["city"] == "Paris"


def test_required_gives_parallel_calls(sdk, server):
    whole, streamed = both(sdk, server, tools=TOOLS, tool_choice="required")
    calls = check_calls(whole, streamed, {"get_weather", "get_time"})
    assert [json.loads(a)["city"] for _, a in calls] == ["Paris", "Rome"]


def test_parallel_tool_calls_false_gives_one_call(sdk, server):
    whole, streamed = both(sdk, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(whole, streamed, {"get_weather", "get_time"})) == 1


def test_tool_without_parameters_gets_empty_object(sdk, server):
    whole, streamed = both(sdk, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert check_calls(whole, streamed, {"get_time"}) == [("get_time", "{}")]


def test_streamed_deltas_have_openai_shape(sdk, server):
    stream = sdk.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=0, stream=True)
    deltas = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    firsts = {}
    for d in deltas:
        if d.index not in firsts:  # a call's first delta: its id and name, no arguments yet
            firsts[d.index] = d
            assert d.id and d.function.name and d.type == "function" and d.function.arguments == ""
        else:
            assert d.id is None and d.function.name is None and d.function.arguments
    assert sorted(firsts) == [0, 1]
    assert sum(1 for d in deltas if d.index == 0) > 2  # arguments arrive in pieces


def test_none_returns_the_plain_content(sdk, server):
    whole, streamed = both(sdk, server, max_tokens=40, tools=TOOLS, tool_choice="none")
    plain = sdk.chat.completions.create(model=server.model, messages=ASK, max_tokens=40, temperature=0).choices[0]
    assert whole.message.content == streamed.message.content == plain.message.content
    assert not whole.message.tool_calls and not streamed.message.tool_calls
    assert whole.finish_reason == plain.finish_reason != "tool_calls"


def test_multi_turn_with_tool_results(sdk, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 25}'}]
    whole, streamed = both(sdk, server, messages=history, max_tokens=40, tools=TOOLS)
    assert whole.message.content == streamed.message.content and whole.finish_reason == streamed.finish_reason
    assert calls_of(whole) == calls_of(streamed)
    again = history + [{"role": "user", "content": "And the time?"}]
    whole, streamed = both(sdk, server, messages=again, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert check_calls(whole, streamed, {"get_time"}) == [("get_time", "{}")]


def test_tokenize_renders_a_tool_history_as_chat_does(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    chat = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1}).json()
    tokens = client.post("/tokenize", json={"messages": history, "return_token_strs": True}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"]
    text = "".join(tokens["token_strs"])
    assert "<tool_call>" in text and "<tool_response>" in text and "<|im_start|>tool" not in text


def test_history_rendering_in_the_hermes_format():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c2", "content": "rainy"}]
    out = render_messages(history, [TIME])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TIME) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"


TEXTS = [
    ("Hello there", "Hello there", []),
    (' <tool_call>\n{"name": "a", "arguments": {"x": {"y": "}"}}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>\n', "", [("a", '{"x": {"y": "}"}}'), ("b", "{}")]),
    ('Sure.\n<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', "Sure.", [("f", '{"x": 1}')]),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', "", [("f", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "", [("f", '{"x": 1}')]),  # ended before the close
    ("<tool_call>not json</tool_call> and a < b <tool", "<tool_call>not json</tool_call> and a < b <tool", []),
]


@pytest.mark.parametrize("text, content, calls", TEXTS)
def test_parser_gives_the_same_calls_for_any_split(text, content, calls):
    for step in (1, 2, 3, 5, len(text)):
        ids = itertools.count()
        parser = ToolCallParser(lambda ids=ids: f"call_{next(ids)}")
        got_content, got = "", {}
        for piece in [text[i:i + step] for i in range(0, len(text), step)] + [None]:
            c, deltas = parser.feed(piece) if piece is not None else parser.finish()
            got_content += c
            for d in deltas:
                if d.id is not None:
                    assert d.index not in got and d.arguments == ""
                    got[d.index] = [d.name, ""]
                got[d.index][1] += d.arguments
        assert got_content == content and [tuple(v) for _, v in sorted(got.items())] == calls, step


def test_langchain_bind_tools_agent_loop(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, model=server.model, temperature=0,
                     max_tokens=80, max_retries=0)
    messages = [HumanMessage("First add 2 and 3, then multiply the result by 10.")]
    results = []
    for step in ("add", "multiply"):  # a 135M model needs each step forced; the arguments are its own
        ai = llm.bind_tools([add, multiply], tool_choice=step).invoke(messages)
        assert [c["name"] for c in ai.tool_calls] == [step]
        messages.append(ai)
        for call in ai.tool_calls:
            results.append({"add": add, "multiply": multiply}[call["name"]].invoke(call["args"]))
            messages.append(ToolMessage(str(results[-1]), tool_call_id=call["id"]))
    assert results == [5, 50]
    final = llm.bind_tools([add, multiply]).invoke(messages)
    assert final.response_metadata["finish_reason"] in ("stop", "tool_calls", "length")


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [TIME, TIME]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "tools",
     "of type object, got type 'foo'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "tools[0].function.parameters must be a JSON schema of type object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {}}}}}}]}, "tools", "'not' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "only an assistant"),
]


@pytest.mark.parametrize("extra, param, fragment", BAD)
def test_bad_tool_fields_are_400s(client, extra, param, fragment):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_call_cut_short_stays_a_call_and_is_not_repeated_as_content():
    """Text ending inside a call (max_tokens or a stop string): the call keeps the arguments generated so far
    (OpenAI's behaviour when max_tokens cuts a call), nothing of it goes to content, and it is marked incomplete
    (the finish reason is then length or stop, never tool_calls)."""
    parser = ToolCallParser(lambda: "call_1")
    content, deltas = parser.feed('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "un')
    more, rest = parser.finish()
    assert content + more == "Sure." and parser.incomplete and len(parser.calls) == 1
    assert deltas[0].name == "get_weather" and "".join(d.arguments for d in deltas + rest).startswith('{"city"')
    whole = ToolCallParser(lambda: "call_2")
    whole.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    whole.finish()
    assert not whole.incomplete and len(whole.calls) == 1


# Qwen2.5's way of writing a call: the template serializes ``arguments`` itself (Hugging Face's object form).
NATIVE_TEMPLATE = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:"
                   "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
                   "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n{% endfor %}")


def test_a_template_with_tools_gets_call_arguments_as_objects():
    """OpenAI's arguments JSON text reaches a tool-aware template as an object, so ``tojson`` writes it once
    (not as an escaped string); the caller's messages are left as they were."""
    from leanserve.structured.tool_template import ToolTemplate
    from leanserve.tokenizer import Tokenizer

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    tok = Tokenizer(HFTokenizer(BPE({"a": 0}, [])), kind="plain", vocab_size=1, bos_token_id=None, eos_token_id=0,
                    stop_token_ids=frozenset({0}), add_bos=False, chat_template=NATIVE_TEMPLATE,
                    special_ids=frozenset())
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}]
    text = ToolTemplate(tok, [TIME]).apply_chat_template(history, add_generation_prompt=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '"arguments": "not json"' in text  # not JSON: passed on as the text it is
    assert text.startswith('TOOLS:[{"type": "function"')
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
