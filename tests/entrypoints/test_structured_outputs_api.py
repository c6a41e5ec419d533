"""Structured outputs over HTTP on the shared server, with the OpenAI SDK.

50 JSON schemas (nested objects, arrays with minItems / maxItems, enums, numbers with minimum / maximum, required
fields, anyOf) at 8 concurrent requests: every output parses and validates with ``jsonschema``; ``json_object``
output parses as an object; regex and choice hold, on both endpoints and under every field name
(``response_format``, ``structured_outputs``, ``guided_*``); ``chat.completions.parse`` with a pydantic model;
every bad value is a 400 in the error envelope naming its field, and the server keeps serving.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WORDS = ["city", "color", "size", "label", "kind", "owner", "state", "code", "title", "level"]
ENUMS = [["red", "green", "blue"], ["small", "large"], ["on", "off"], ["north", "south", "east", "west"]]


def leaf(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        return {"type": "string", "maxLength": rng.choice([4, 8, 12])}
    if kind == 1:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([1, 9, 100])}
    if kind == 2:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == 3:
        return {"enum": rng.choice(ENUMS)}
    return {"type": "boolean"}


def make_schema(i: int) -> dict:
    """Schema ``i`` of 50: 2-4 properties of scalars, enums, bounded arrays, nested objects and anyOf."""
    rng = random.Random(i)
    props = {}
    for name in rng.sample(WORDS, rng.randint(2, 4)):
        shape = rng.randrange(6)
        if shape == 0:
            lo = rng.randint(0, 2)
            props[name] = {"type": "array", "items": leaf(rng), "minItems": lo, "maxItems": lo + rng.randint(1, 2)}
        elif shape == 1:
            inner = {w: leaf(rng) for w in rng.sample(WORDS, 2)}
            props[name] = {"type": "object", "properties": inner, "required": list(inner)[:1]}
        elif shape == 2:
            props[name] = {"anyOf": [leaf(rng), {"type": "null"}]}
        else:
            props[name] = leaf(rng)
    required = [n for n in props if rng.random() < 0.7] or list(props)[:1]
    return {"type": "object", "properties": props, "required": required}


SCHEMAS = [make_schema(i) for i in range(50)]


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def ask(sdk, server, content: str, max_tokens: int = 100, **kwargs):
    return sdk.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                       max_tokens=max_tokens, temperature=0, **kwargs)


def test_fifty_schemas_at_eight_concurrent_requests_all_validate(sdk, server):
    covered = json.dumps(SCHEMAS)
    for keyword in ('"anyOf"', '"minItems"', '"maxItems"', '"enum"', '"minimum"', '"maximum"', '"required"',
                    '"type": "object", "properties": {"'):
        assert keyword in covered

    def one(i: int):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        r = ask(sdk, server, f"Fill in this record ({', '.join(SCHEMAS[i]['properties'])}) as JSON.",
                response_format=fmt)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(len(SCHEMAS))))
    for i, c in enumerate(choices):
        assert c.finish_reason == "stop", (i, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[i])


@pytest.mark.parametrize("content", ["Write a JSON object with the keys x and y set to 1 and 2.",
                                     "Reply in JSON: is the sun hot?",
                                     'Answer in JSON with the key "answer": what is 2 + 2?'])
def test_json_object_always_parses(sdk, server, content):
    c = ask(sdk, server, content, max_tokens=60, response_format={"type": "json_object"}).choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def test_regex_and_choice_on_both_endpoints_and_every_field_name(sdk, server):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for body in ({"guided_regex": phone}, {"structured_outputs": {"regex": phone}}):
        r = sdk.completions.create(model=server.model, prompt="Call me at", max_tokens=20, temperature=0,
                                   extra_body=body)
        assert re.fullmatch(phone, r.choices[0].text), r.choices[0].text
        c = ask(sdk, server, "Your phone number?", max_tokens=20, extra_body=body).choices[0]
        assert re.fullmatch(phone, c.message.content), c.message.content
    options = ["yes", "no", "only on Tuesdays"]
    for body in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        r = sdk.completions.create(model=server.model, prompt="Is water wet? Answer:", max_tokens=10,
                                   temperature=0.7, seed=3, n=3, extra_body=body)
        assert all(ch.text in options for ch in r.choices), [ch.text for ch in r.choices]
        assert ask(sdk, server, "Is water wet?", max_tokens=10, extra_body=body).choices[0].message.content in options
    r = sdk.completions.create(model=server.model, prompt="A list:", max_tokens=30, temperature=0,
                               extra_body={"guided_grammar": 'root ::= "[" [0-9] (", " [0-9]){0,3} "]"'})
    assert re.fullmatch(r"\[[0-9](, [0-9]){0,3}\]", r.choices[0].text), r.choices[0].text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        r = sdk.completions.create(model=server.model, prompt="JSON:", max_tokens=20, temperature=0, extra_body=body)
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_streamed_structured_output_is_the_whole_one(sdk, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    whole = ask(sdk, server, "A record as JSON.", response_format=fmt).choices[0].message.content
    stream = ask(sdk, server, "A record as JSON.", response_format=fmt, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), SCHEMAS[0])


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address


def test_sdk_parse_with_a_pydantic_model(sdk, server):
    r = sdk.chat.completions.parse(model=server.model, messages=[{"role": "user", "content": "Invent a person."}],
                                   response_format=Person, max_tokens=100, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    assert 0 <= person.age <= 120


BAD = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "at most one"),
    ("completion", {"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "minimum"),
    ("completion", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("completion", {"guided_regex": "(("}, "guided_regex", "parenthesis"),
    ("completion", {"guided_choice": []}, "guided_choice", "must not be empty"),
    ("completion", {"guided_choice": "yes"}, "guided_choice", "guided_choice"),
    ("completion", {"guided_grammar": 'x ::= "a"'}, "guided_grammar", "root"),
    ("completion", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"grammar": 7}}, "structured_outputs", "structured_outputs.grammar"),
    ("completion", {"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ("completion", {"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "min_tokens"),
]


@pytest.mark.parametrize("endpoint, extra, param, fragment", BAD)
def test_bad_values_are_400s_naming_the_field(client, server, endpoint, extra, param, fragment):
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "hi"}
    r = client.post(path, json={**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert fragment in err["message"], err
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
