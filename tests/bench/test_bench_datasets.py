"""Dataset readers: ShareGPT JSON / JSONL conversations and JSONL prompts."""

from __future__ import annotations

import json

from leanserve.bench.datasets import load_dataset

import pytest

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Explain what a hash table is, briefly please."},
                                  {"from": "gpt", "value": "A hash table maps keys to values with a hash function "
                                                           "that picks a bucket for each key."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Only one turn here, so it is skipped."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
    {"id": "d", "messages": [{"role": "user", "content": "Write a haiku about the sea and the wind."},
                             {"role": "assistant", "content": "Waves fold into foam / the wind carries salt "
                                                              "inland / gulls argue above"}]},
]


def test_sharegpt_json_list(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    reqs = load_dataset(path, tokenizer, num_prompts=10, seed=None)
    # "b" has one turn and "c" a 1-token prompt: skipped
    assert [r.prompt for r in reqs] == [CONVERSATIONS[0]["conversations"][0]["value"],
                                        CONVERSATIONS[3]["messages"][0]["content"]]
    reply = CONVERSATIONS[0]["conversations"][1]["value"]
    assert reqs[0].max_tokens == len(tokenizer.encode(reply, add_special_tokens=False))
    assert reqs[0].prompt_len == len(tokenizer.encode(reqs[0].prompt, add_special_tokens=False))
    assert reqs[0].messages == [{"role": "user", "content": reqs[0].prompt}]


def test_sharegpt_jsonl_and_limit(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n\n")
    assert len(load_dataset(path, tokenizer, num_prompts=1, seed=None)) == 1
    assert len(load_dataset(path, tokenizer, num_prompts=10, seed=None)) == 2


def test_prompt_jsonl_shuffled_by_seed(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Prompt number {i}: say something.", "max_tokens": 10 + i} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ordered = load_dataset(path, tokenizer, num_prompts=20, seed=None)
    assert [r.max_tokens for r in ordered] == list(range(10, 30))
    a = load_dataset(path, tokenizer, num_prompts=5, seed=1)
    assert a == load_dataset(path, tokenizer, num_prompts=5, seed=1)
    assert [r.prompt for r in a] != [r.prompt for r in load_dataset(path, tokenizer, num_prompts=5, seed=2)]
    assert {r.prompt for r in a} <= {r["prompt"] for r in rows}


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "x", "max_tokens": 3}\nnot json\n', ":2: not JSON"),
    ('{"prompt": "x"}\n', "integer 'max_tokens'"),
    ('{"question": "x"}\n', "neither"),
    ('[{"conversations": []}]', "no usable request"),
    # records are named by their line in the file, not by their place after the shuffle
    ('{"prompt": "a", "max_tokens": 3}\n{"prompt": "b", "max_tokens": 4}\n{"prompt": "c", "max_tokens": 0}\n',
     "record 3: .*'max_tokens' >= 1"),
    ('{"prompt": "a", "max_tokens": true}\n', "record 1: "),
    (b'{"prompt": "\xff", "max_tokens": 3}\n', "not UTF-8"),
])
def test_bad_files(tmp_path, tokenizer, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_dataset(path, tokenizer, num_prompts=5)
