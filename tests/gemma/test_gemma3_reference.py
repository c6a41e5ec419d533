"""Gemma 3 270M against transformers and gguf-py: the tokenizer, greedy generation through the engine (8 prompts),
and the dequantization of every tensor type the Q4_K_M file holds."""

from __future__ import annotations

from leanserve import LLM, SamplingParams
from leanserve.loader.gguf_tensors import dequantize_tensor, open_gguf

import gguf
import numpy as np
import torch

from tests.conftest import assert_no_leaks
from tests.engine.test_greedy_vs_transformers import hf_greedy

TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs of   spaces\n\nand blank lines\t\ttabs",
    "def f(x):\n    return x ** 2  # squares\n",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🤖🚀, math ∑ x² ≤ ∞",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "Numbers 1234567890 and 3.14159, URLs https://example.com/a?b=c&d=e",
    "",
    "a",
]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "1, 2, 3, 4, 5,",
]
STEPS = 16


def test_tokenizer_equals_transformers(gemma_loaded, gemma_hf_tokenizer):
    ours, ref = gemma_loaded.tokenizer, gemma_hf_tokenizer
    assert ours.vocab_size == len(ref) == 262144
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (2, 1)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_no_chat_template_in_the_file(gemma_loaded):
    """The GGUF (a base model) carries no tokenizer.chat_template: the chat endpoint has none to apply."""
    assert gemma_loaded.tokenizer.chat_template is None


def test_greedy_generation_equals_transformers(gemma_loaded, gemma_hf):
    """The engine (chunked prefill, paged cache, native decode kernel on global layers) against transformers'
    argmax loop; where the reference's top-2 gap is under 1e-3 either token is correct and the comparison stops."""
    llm = LLM(loaded=gemma_loaded, kv_cache_memory=64 << 20, max_model_len=2048)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    compared = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        ref_ids, ref_logits = hf_greedy(gemma_hf, ids, STEPS)
        got = out.outputs[0].token_ids
        assert len(got) == STEPS
        for step in range(STEPS):
            top2 = torch.topk(ref_logits[step], 2).values
            if (top2[0] - top2[1]).item() < 1e-3:
                break
            assert got[step] == ref_ids[step], f"{prompt!r} differs at step {step}: {got} vs {ref_ids}"
            compared += 1
    assert compared >= 0.9 * len(PROMPTS) * STEPS
    assert_no_leaks(llm.engine)


def test_dequantization_equals_gguf_reference(gemma_path):
    """Every tensor type in the file (Q4_K, Q6_K, Q5_0, Q8_0, F32) dequantizes exactly as gguf.quants.dequantize."""
    reader = open_gguf(gemma_path)
    seen: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if seen.get(name, 0) >= 3 or t.name.startswith("token_embd"):
            continue  # three tensors of each type are enough (the Q8_0 embedding: the next test)
        seen[name] = seen.get(name, 0) + 1
        ours = dequantize_tensor(t)
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ours.shape)
        assert ours.dtype == np.float32 and np.array_equal(ours, ref), t.name
    assert set(seen) == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_native_embedding_rows_equal_dequantized(gemma_loaded, gemma_path):
    """The Q8_0 embedding kept in its file bytes (block kernel, lane layout) returns the reference's rows exactly."""
    from leanserve.kernels import native_ops
    from leanserve.quantization.weights import pack_group_quantized

    emb = pack_group_quantized(gemma_loaded.weights["model.embed_tokens.weight"], native_ops())
    ids = [0, 1, 2, 818, 5279, 262143]
    t = next(t for t in open_gguf(gemma_path).tensors if t.name == "token_embd.weight")
    rows = np.asarray(t.data).reshape(262144, -1)[ids]  # each row is whole blocks: dequantize only those
    ref = gguf.quants.dequantize(rows, t.tensor_type).reshape(len(ids), 640)
    assert torch.equal(emb.rows(torch.tensor(ids)), torch.from_numpy(ref))
