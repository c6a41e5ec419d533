"""Our tokenizer on the default model vs transformers' tokenizer built from the same GGUF file."""

from __future__ import annotations

import os

from leanserve.errors import InvalidParameterError, ModelLoadError
from leanserve.loader import default_model_path
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.tokenizer import Tokenizer

import pytest

TEXTS = [
    "Hello, world! How are you today?",
    "def f(x):\n\tif x:\n        return  x  # indented\n\treturn None\n",
    "12345.678 + 3.14159 = 1,000,000 and 2024-05-01",
    "你好，世界",
    "👍🏽 emoji 🎉 and ZWJ 👨‍👩‍👧",
    "a  b   c\n\n\nd \n  e\t\tf",
    "<|im_start|>user\nhi<|im_end|>\n",
    " leading space",
    "trailing spaces   ",
    "I'm sure they're fine, we'll see; it'd be OK.",
    "Ünïcödé çäşé — “curly quotes” … ©",
    "x = [1,2,3]; y = {'a': 1}  # dict\n",
    "<|endoftext|>after<repo_name>name",
    "URL: https://example.com/path?q=1&r=2",
    "   ",
    "",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, ref, text):
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_single_ids(ours):
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert ours.is_special(1) and ours.is_special(2) and ours.is_special(0) and not ours.is_special(4093)
    assert ours.decode([1, 4093, 2]) == "user"


def test_metadata(ours):
    assert ours.vocab_size == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (1, 2, False)
    assert 2 in ours.stop_token_ids and ours.eos_token_id in ours.stop_token_ids
    assert ours.stop_token_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)
    assert ours.chat_template.startswith("{% for message in messages %}")


def test_chat_template_matches_transformers(ours, ref):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    no_prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == no_prompt
    # Default system prompt of the template when none is given; content as a list of text parts.
    text_parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    parts = [{"role": "user", "content": text_parts}]
    plain = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(parts) == ref.apply_chat_template(plain, tokenize=False,
                                                                      add_generation_prompt=True)


def test_chat_template_errors(ours):
    with pytest.raises(InvalidParameterError) as info:
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    assert info.value.param == "messages"
    common = dict(kind="byte_level", vocab_size=49152, bos_token_id=1, eos_token_id=2,
                  stop_token_ids=frozenset({2}), add_bos=False, special_ids=frozenset({0, 1, 2}))
    no_template = Tokenizer(ours._backend, chat_template=None, **common)
    with pytest.raises(InvalidParameterError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = Tokenizer(ours._backend, chat_template="{{ raise_exception('roles must alternate') }}",
                        **common)
    with pytest.raises(InvalidParameterError, match="roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelLoadError, match="chat template"):
        Tokenizer(ours._backend, chat_template="{% for m in %}", **common)  # broken: fails at load


def test_token_bytes(ours, ref):
    ids = ours.encode("你好")
    assert b"".join(ours.token_bytes(i) for i in ids) == "你好".encode()
    # Each character is split across two tokens: "你" = E4 BD A0 -> [E4 BD] [A0].
    assert [ours.token_bytes(i) for i in ids] == [b"\xe4\xbd", b"\xa0", b"\xe5\xa5", b"\xbd"]
    for text in TEXTS:
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text
    assert ours.token_bytes(1) == b"<|im_start|>"
    assert ours.token_bytes(216) == b" "  # "Ġ"
    with pytest.raises(IndexError):
        ours.token_bytes(49152)


def test_from_dir_of_saved_transformers_tokenizer(ours, ref, tmp_path):
    ref.save_pretrained(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text), text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos) == (1, 2, False)
    assert loaded.vocab_size == 49152 and loaded.stop_token_ids == {0, 2}
    assert loaded.chat_template == ours.chat_template
    ids = ours.encode("你好 <|im_end|>")
    assert [loaded.token_bytes(i) for i in ids] == [ours.token_bytes(i) for i in ids]
    assert loaded.decode(ids) == ours.decode(ids) and loaded.is_special(2) and not loaded.is_special(4093)


def test_min_num_tokens_is_a_lower_bound(ours, ref, tmp_path):
    longest = max(len(ours.token_bytes(i)) for i in range(ours.vocab_size))
    texts = [*TEXTS, "\n" + " " * 80, ("\n" + " " * 80) * 50, "word " * 5000, "你好" * 300]
    for text in texts:
        n = len(ours.encode(text))
        assert ours.min_num_tokens(text) <= n, text[:40]
        assert ours.min_num_tokens(text) == -(-len(text.encode()) // longest)  # no BOS on this model
    # the longest token repeated is spelled by exactly that many tokens: the bound is tight there
    tight = ("\n" + " " * 80) * 50
    assert len(ours.encode(tight)) == ours.min_num_tokens(tight) == 50
    # a normalizer that may shorten the text (NFKC here) gives no bound rather than a wrong one
    from tokenizers import normalizers

    ref.save_pretrained(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.min_num_tokens("word " * 100) == ours.min_num_tokens("word " * 100) > 0
    loaded._backend.normalizer = normalizers.NFKC()
    nfkc = Tokenizer(loaded._backend, kind="byte_level", vocab_size=loaded.vocab_size, bos_token_id=None,
                     eos_token_id=2, stop_token_ids=frozenset({2}), add_bos=False, chat_template=None,
                     special_ids=frozenset())
    assert nfkc.min_num_tokens("word " * 100) == 0


def _bpe_tokenizer(**parts):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>|")}}
    backend = HFTokenizer(BPE(vocab, [], unk_token=parts.pop("unk", None), byte_fallback=parts.pop("fb", False)))
    for name, value in parts.items():
        setattr(backend, name, value)
    return backend


@pytest.mark.parametrize("case", ["plain", "whitespace_split", "split_removed", "lstrip_token", "fused_unk",
                                  "unk_with_byte_fallback"])
def test_min_num_tokens_gives_no_bound_where_text_can_vanish(case):
    """Each case but the first two drops bytes of the text before or while tokenizing (spaces removed by the
    pre-tokenizer, spaces eaten by an lstrip added token, a run of unknown characters fused into one
    ``<unk>``): a bound from the text's length would overshoot, so there is none (0)."""
    from tokenizers import AddedToken, Regex, pre_tokenizers

    backend = {
        "plain": lambda: _bpe_tokenizer(),
        "whitespace_split": lambda: _bpe_tokenizer(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
        "split_removed": lambda: _bpe_tokenizer(pre_tokenizer=pre_tokenizers.Split(Regex(" +"), "removed")),
        "lstrip_token": lambda: _bpe_tokenizer(),
        "fused_unk": lambda: _bpe_tokenizer(unk="<unk>"),
        "unk_with_byte_fallback": lambda: _bpe_tokenizer(unk="<unk>", fb=True),
    }[case]()
    if case == "lstrip_token":
        backend.add_special_tokens([AddedToken("<|end|>", lstrip=True, rstrip=True)])
    tok = Tokenizer(backend, kind="sentencepiece", vocab_size=backend.get_vocab_size(), bos_token_id=None,
                    eos_token_id=0, stop_token_ids=frozenset({0}), add_bos=False, chat_template=None,
                    special_ids=frozenset())
    text = "ab" + " " * 40 + "<|end|>" + " " * 40 + "cd"
    bound = tok.min_num_tokens(text)
    assert bound <= len(tok.encode(text))
    if case in ("plain", "unk_with_byte_fallback"):
        assert bound > 0
    else:
        assert bound == 0


def test_long_text_encodes_the_same_with_the_gil_released(ours, ref):
    import threading
    import time

    text = "The quick brown fox, 你好 👍🏽. " * 2000  # over the 32,768 characters that switch to encode_batch
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    big = "word " * 200_000
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            time.sleep(0.001)
            ticks.append(1)

    ticker = threading.Thread(target=tick)
    ticker.start()
    ids = ours.encode(big)
    done.set()
    ticker.join()
    assert len(ids) == 200_001 and ids[1:3] == ids[2:4]  # the first "word" has no leading space: its own token
    # with the GIL held for the whole encode the ticker gets at most a couple of turns
    assert len(ticks) >= 20


@pytest.mark.parametrize("byte_fallback", [False, True])
@pytest.mark.parametrize("unk", [None, "<unk>"])
def test_spells_every_byte_reads_the_bpe_flags_as_its_json_states_them(byte_fallback: bool, unk: str | None) -> None:
    """The bound's condition on the model (byte fallback, or no unknown token) read from a BPE model's attributes
    agrees with its serialized state (the form other model types are read in)."""
    import json

    from leanserve.tokenizer import _spells_every_byte

    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3}
    backend = Backend(BPE(vocab, [("a", "b")], unk_token=unk, byte_fallback=byte_fallback))
    state = json.loads(backend.model.__getstate__())
    assert (state["byte_fallback"], state["unk_token"]) == (byte_fallback, unk)
    assert _spells_every_byte(backend) == (byte_fallback or unk is None)
