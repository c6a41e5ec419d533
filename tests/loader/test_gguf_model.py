"""Tiny complete GGUF models, written with gguf-py: config, HF weights (q/k layout) and tokenizer."""

from __future__ import annotations

import math

from leanserve.errors import ModelLoadError, UnsupportedTensorTypeError
from leanserve.loader import load_model
from leanserve.loader.gguf_loader import gguf_model_config, unpermute_qk
from leanserve.loader.gguf_tensors import open_gguf

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_helpers import gpt2_vocab, random_blocks

L, H, INTER, NH, NKV, HD = 2, 64, 96, 4, 2, 16
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF row order of q/k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    pieces = ["▁", "t", "h", "e", "l", "o", "he", "▁t", "▁the", "ll", "llo", "▁h", "▁hello", "ello", "▁he"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def hf_weights(vocab: int, bias: bool, tie: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,)}
    if not tie:
        shapes["lm_head.weight"] = (vocab, H)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (NH * HD, H),
                   p + "self_attn.k_proj.weight": (NKV * HD, H), p + "self_attn.v_proj.weight": (NKV * HD, H),
                   p + "self_attn.o_proj.weight": (H, NH * HD), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
                   p + "mlp.down_proj.weight": (H, INTER)}
        if bias:
            shapes |= {p + "self_attn.q_proj.bias": (NH * HD,), p + "self_attn.k_proj.bias": (NKV * HD,),
                       p + "self_attn.v_proj.bias": (NKV * HD,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_model(write_gguf, arch="llama", tokenizer="gpt2", tie=True, extra_tensors=(), meta=None):
    """A tiny model GGUF as llama.cpp's converter would write it; returns (path, HF-layout weights)."""
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
    else:
        tokens, types, scores = sentencepiece_vocab()
    weights = hf_weights(len(tokens), bias=arch == "qwen2", tie=tie)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_block_count(L)
        w.add_context_length(512)
        w.add_embedding_length(H)
        w.add_feed_forward_length(INTER)
        w.add_head_count(NH)
        w.add_head_count_kv(NKV)
        w.add_rope_dimension_count(HD)
        w.add_rope_freq_base(1e6 if arch == "qwen2" else 10000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(tokens)
        w.add_token_types(types)
        if tokenizer == "gpt2":
            w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
            w.add_token_merges(merges)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            w.add_add_bos_token(False)
            w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
        else:
            w.add_token_scores(scores)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            w.add_unk_token_id(0)
        if meta:
            meta(w)

    tensors = []
    for name, array in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{GGUF_NAMES[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                array = llama_cpp_permute(array, NH)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                array = llama_cpp_permute(array, NKV)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                     "model.norm.weight": "output_norm.weight"}[name]
        tensors.append((gname, array, None))
    path = write_gguf(f"tiny-{arch}-{tokenizer}.gguf", arch, tensors + list(extra_tensors), metadata)
    return path, weights


@pytest.mark.parametrize("arch, tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_tiny_model_loads_config_and_hf_layout_weights(write_gguf, arch, tie):
    path, expected = write_tiny_model(write_gguf, arch=arch, tie=tie)
    model = load_model(path)
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == (arch, L, H, INTER)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (NH, NKV, HD, len(gpt2_vocab()[0]))
    assert (c.max_position_embeddings, c.rms_norm_eps, c.rope_scaling) == (512, 1e-6, None)
    assert c.rope_theta == (1e6 if arch == "qwen2" else 10000.0)
    assert c.tie_word_embeddings is tie and c.attention_bias is (arch == "qwen2")
    assert set(model.weights) == set(expected)
    for name, array in expected.items():  # q/k un-permuted back to HF (llama); qwen2 never permuted
        tensor = model.weights[name]
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, torch.from_numpy(array)), name
    assert model.path == path and 0 < model.load_time_s < 10


def test_tiny_model_tokenizer(write_gguf):
    path, _ = write_tiny_model(write_gguf)
    tok = load_model(path).tokenizer
    tokens = gpt2_vocab()[0]
    ids = tok.encode("<|im_start|>the the he<|im_end|>")
    # merge ranks decide: "h e" (rank 1) beats "Ġ h" (rank 3), so " he" never becomes "Ġhe"
    assert [tokens[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġthe", "Ġ", "he", "<|im_end|>"]
    assert tok.decode(ids) == "the the he"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the the he<|im_end|>"
    assert tok.stop_token_ids == {0, 2} and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert not tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(3)
    for n_head, rows, cols in [(4, 64, 8), (2, 32, 8), (9, 576, 3), (3, 192, 1)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
        b = w[:, 0].copy()  # 1-D (bias) too
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(b, n_head), n_head), b)
    # A concrete case: per head, GGUF interleaves the two rotary halves: rows 0,2,1,3 <- HF rows 0,1,2,3.
    hf = np.arange(8, dtype=np.float32).reshape(8, 1)
    gguf_rows = llama_cpp_permute(hf, 2).ravel().tolist()
    assert gguf_rows == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_qk(np.array(gguf_rows, np.float32), 2).tolist() == list(range(8))


def test_sentencepiece_tokenizer_matches_transformers(write_gguf, tmp_path):
    from transformers import AutoTokenizer

    path, _ = write_tiny_model(write_gguf, tokenizer="llama")
    ours = load_model(path).tokenizer
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.rsplit("/", 1)[1])
    assert ours.add_bos and ours.bos_token_id == 1 and ours.stop_token_ids == {2}
    for text in ["the hello", "hello the\nhe", "Ωmega tel", " the  he ", "<s>the</s>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    ids = ours.encode("Ω")  # byte fallback: U+03A9 is 0xCE 0xA9
    assert ids == [1, 3 + 256, 3 + 0xCE, 3 + 0xA9]  # BOS, "▁" (first piece), then the two bytes <0xCE> <0xA9>
    assert b"".join(ours.token_bytes(i) for i in ids[1:]) == " Ω".encode()


def _rope_file(write_gguf, head_dim: int, meta, factors: np.ndarray | None = None):
    tensors = [("token_embd.weight", np.zeros((8, head_dim), np.float32), None)]
    if factors is not None:
        tensors.append(("rope_freqs.weight", factors.astype(np.float32), None))

    def metadata(w: gguf.GGUFWriter) -> None:
        for key, value in {"block_count": 1, "context_length": 131072, "embedding_length": head_dim,
                           "feed_forward_length": 8, "attention.head_count": 1}.items():
            w.add_uint32(f"llama.{key}", value)
        w.add_float32("llama.rope.freq_base", 500000.0)
        meta(w)

    return gguf_model_config(open_gguf(write_gguf("rope.gguf", "llama", tensors, metadata)))


def llama_cpp_rope_factors(head_dim, base, factor, low, high, orig):
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


@pytest.mark.parametrize("factor, low, high, orig", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                                     (16.0, 2.0, 8.0, 4096)])
def test_llama3_rope_freqs_become_hf_rope_scaling(write_gguf, factor, low, high, orig):
    factors = llama_cpp_rope_factors(128, 500000.0, factor, low, high, orig)
    meta = (lambda w: w.add_rope_scaling_orig_ctx_len(orig)) if orig != 8192 else (lambda w: None)
    config = _rope_file(write_gguf, 128, meta, factors)
    assert config.rope_scaling == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                   "high_freq_factor": high, "original_max_position_embeddings": orig}


def test_linear_and_yarn_rope_metadata(write_gguf):
    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    assert _rope_file(write_gguf, 16, linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    assert _rope_file(write_gguf, 16, yarn).rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_unsupported_tensor_type_in_a_model_fails_the_load(write_gguf):
    bad = [("blk.1.extra", random_blocks(QT.IQ2_XXS, (2, 256)), QT.IQ2_XXS)]
    path, _ = write_tiny_model(write_gguf, extra_tensors=bad)
    with pytest.raises(UnsupportedTensorTypeError, match=r"blk\.1\.extra.*IQ2_XXS"):
        load_model(path)


def test_bad_models_raise_model_load_error(write_gguf, tmp_path):
    mystery = [("blk.0.mystery.weight", np.zeros(4, np.float32), None)]
    path, _ = write_tiny_model(write_gguf, extra_tensors=mystery)
    with pytest.raises(ModelLoadError, match="mystery"):
        load_model(path)
    other = write_gguf("gpt2.gguf", "gpt2", [("token_embd.weight", np.zeros((4, 4), np.float32), None)])
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        load_model(other)
    (tmp_path / "notgguf.bin").write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(str(tmp_path / "notgguf.bin"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))

