"""Tokenizers built from GGUF vocabularies: pre-tokenizer choice, errors, plain-value metadata."""

from __future__ import annotations

from leanserve.errors import ModelLoadError
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.tokenizer import Tokenizer

import gguf
import numpy as np
import pytest
from gguf_helpers import gpt2_vocab, write_gguf_file


def _vocab_meta(pre: str | None, model: str = "gpt2") -> dict:
    tokens, types, merges = gpt2_vocab()
    digits = ["12", "123", "45", "ĠĠ", "ĊĊ", "Ġ1"]
    meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens + digits,
            "tokenizer.ggml.token_type": types + [1] * len(digits),
            "tokenizer.ggml.merges": merges + ["1 2", "12 3", "4 5", "Ġ Ġ", "Ċ Ċ", "Ġ 1"],
            "tokenizer.ggml.eos_token_id": 2}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_pre_tokenizers_match_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    meta = _vocab_meta(pre)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_uint32("llama.block_count", 1)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        w.add_eos_token_id(2)

    write_gguf_file(tmp_path / "v.gguf", "llama", [("token_embd.weight", np.zeros((4, 4), np.float32), None)],
                    metadata)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="v.gguf")
    ours = Tokenizer.from_gguf(open_gguf(tmp_path / "v.gguf"))
    for text in ["x 12345  \n\n the 2024", "a  1", "t\n\n\n  12"]:
        assert ours.encode(text) == ref.encode(text), (pre, text)


def test_smollm_splits_digits_one_by_one():
    tok = Tokenizer.from_gguf(_vocab_meta("smollm"))  # plain values work too
    tokens = _vocab_meta("smollm")["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in tok.encode(" 12345")] == ["Ġ", "1", "2", "3", "4", "5"]
    gpt2 = Tokenizer.from_gguf(_vocab_meta("gpt2"))
    assert [tokens[i] for i in gpt2.encode(" 12345")] == ["Ġ", "123", "45"]  # merge "1 2" outranks "Ġ 1"


def test_unknown_tokenizer_or_pre_tokenizer_is_an_error():
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'made-up'"):
        Tokenizer.from_gguf(_vocab_meta("made-up"))
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf(_vocab_meta("gpt2", model="bert"))
    missing, gpt2 = Tokenizer.from_gguf(_vocab_meta(None)), Tokenizer.from_gguf(_vocab_meta("gpt2"))
    assert missing.encode(" 12345 the") == gpt2.encode(" 12345 the")  # no pre named: GPT-2's, with a warning
