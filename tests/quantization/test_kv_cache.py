"""The int8 and float16 KV caches: quantization error, attention against the fp32 cache, capacity in the engine."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.config import EngineConfig
from leanserve.engine.llm_engine import LLMEngine
from leanserve.errors import InvalidParameterError, UnsupportedQuantizationError
from leanserve.kernels import native_ops
from leanserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, paged_attention
from leanserve.quantization.kv_cache import Int8KVCache, kv_bytes_per_token, quantize_per_token_head
from leanserve.sampling_params import SamplingParams

import pytest
import torch

BS, KVH, D, HEADS = 16, 3, 64, 9


def test_quantize_per_token_head_error_bound() -> None:
    x = torch.randn(50, KVH, D) * torch.rand(50, KVH, 1) * 4
    x[3, 1] = 0  # an all-zero row stays exact
    q, scale = quantize_per_token_head(x)
    assert q.dtype == torch.int8 and scale.shape == (50, KVH)
    err = (q.float() * scale[..., None] - x).abs()
    assert torch.all(err <= scale[..., None] / 2 + 1e-7)
    assert torch.equal(q[3, 1], torch.zeros(D, dtype=torch.int8))


def _caches(num_blocks: int, gen: torch.Generator):
    """A random fp32 cache and an int8 cache holding the same tokens (written through Int8KVCache.write)."""
    k = torch.randn(num_blocks, BS, KVH, D, generator=gen)
    v = torch.randn(num_blocks, BS, KVH, D, generator=gen)
    k8, v8 = Int8KVCache.zeros(num_blocks, BS, KVH, D), Int8KVCache.zeros(num_blocks, BS, KVH, D)
    slots = torch.arange(num_blocks * BS)
    k8.write(k.view(-1, KVH, D), slots)
    v8.write(v.view(-1, KVH, D), slots)
    return k, v, k8, v8


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def test_int8_cache_attention_close_to_fp32() -> None:
    """Decodes (batched, padded) and a prefill chunk after cached context: int8 within 1e-2 relative of fp32."""
    gen = torch.Generator().manual_seed(0)
    k, v, k8, v8 = _caches(48, gen)
    lens = [5, 40, 200]
    tables = [list(range(0, 1)), list(range(1, 4)), list(range(4, 17))]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BS)[None] < seq_lens[:, None]).view(len(lens), 1, 1, -1)
    # then a 20-token prefill chunk of a fourth sequence with 100 tokens of context in blocks 20..27
    ctx, n = 100, 20
    chunk_blocks = torch.arange(20, 28)
    q_pos, k_pos = torch.arange(ctx, ctx + n), torch.arange(ctx + n)
    chunk = PrefillChunk(len(lens), n, ctx, chunk_blocks, mask=k_pos[None, :] <= q_pos[:, None])
    t = len(lens) + n
    q = torch.randn(t, HEADS, D, generator=gen)
    k_new = torch.randn(t, KVH, D, generator=gen)
    v_new = torch.randn(t, KVH, D, generator=gen)
    slots = [tb[(m - 1) // BS] * BS + (m - 1) % BS for tb, m in zip(tables, lens, strict=True)]
    slots += [int(chunk_blocks[p // BS]) * BS + p % BS for p in range(ctx, ctx + n)]

    def run(kc, vc):
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots),
                                 decode_groups=[DecodeGroup(0, len(lens), table, seq_lens, mask)], prefills=[chunk])
        return paged_attention(q, k_new, v_new, kc, vc, meta)

    ref, out = run(k, v), run(k8, v8)
    for i in range(len(lens)):
        assert _rel_err(out[i], ref[i]) < 1e-2
    assert _rel_err(out[len(lens):], ref[len(lens):]) < 1e-2
    assert (out - ref).abs().max() / ref.abs().max() < 1e-2


def test_kv_int8_capacity_and_errors(loaded) -> None:
    cfg = loaded.config
    fp32, int8 = kv_bytes_per_token(cfg), kv_bytes_per_token(cfg, "int8")
    assert fp32 == 46080 and int8 == 2 * 30 * 3 * (64 + 4)
    assert fp32 / int8 >= 3.5
    assert kv_bytes_per_token(cfg, "auto", "bfloat16") / int8 >= 1.75
    mem = 32 << 20
    e32 = LLMEngine(EngineConfig(kv_cache_memory=mem, quantization="none"), loaded=loaded)
    e8 = LLMEngine(EngineConfig(kv_cache_memory=mem, quantization="none", kv_cache_dtype="int8"), loaded=loaded)
    assert e8.kv.num_tokens_capacity() >= 3.5 * e32.kv.num_tokens_capacity()
    k0 = e8.runner.kv_caches[0][0]
    assert isinstance(k0, Int8KVCache) and k0.nbytes * 2 * cfg.num_layers <= mem
    # greedy decoding through the int8 cache starts like the fp32 one on a prompt with a clear answer
    assert _greedy(e32, 6)[:3] == _greedy(e8, 6)[:3]
    with pytest.raises(UnsupportedQuantizationError, match="kv_cache_dtype"):
        LLMEngine(EngineConfig(kv_cache_dtype="fp8"), loaded=loaded)


def test_kv_float16_capacity_and_agreement(loaded) -> None:
    """A float16 cache holds twice the fp32 cache's tokens, runs the native decode kernel, and decodes greedily
    like the fp32 cache on a prompt with a clear answer (the same tokens here)."""
    cfg = loaded.config
    assert kv_bytes_per_token(cfg, "float16") == kv_bytes_per_token(cfg) // 2 == 23040
    mem = 32 << 20
    e32 = LLMEngine(EngineConfig(kv_cache_memory=mem), loaded=loaded)
    e16 = LLMEngine(EngineConfig(kv_cache_memory=mem, kv_cache_dtype="float16"), loaded=loaded)
    assert 0 <= e16.kv.num_tokens_capacity() - 2 * e32.kv.num_tokens_capacity() <= 16  # whole blocks of 16
    assert e16.runner.kv_caches[0][0].dtype == torch.float16
    assert (e16.runner.decode_kernel is not None) == (native_ops() is not None)
    assert _greedy(e32, 16) == _greedy(e16, 16)


def _greedy(engine: LLMEngine, max_tokens: int) -> list[int]:
    """Greedy token ids for a prompt with a clear answer, through the engine loop."""
    engine.add_request("r", "The capital of France is", SamplingParams(temperature=0, max_tokens=max_tokens))
    out = []
    while engine.has_unfinished_requests():
        out += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    return out[0]


def test_kv_cache_prefault_leaves_the_output_unchanged(loaded) -> None:
    """--kv-cache-prefault: the pool resident at start (all of it, not only what requests wrote), the same greedy
    tokens as a lazily faulted pool; a non-boolean value is refused."""
    from tests.quantization.test_anon_memory import _mapping

    mem = 16 << 20
    lazy = LLMEngine(EngineConfig(kv_cache_memory=mem, kv_cache_dtype="float16"), loaded=loaded)
    eager = LLMEngine(EngineConfig(kv_cache_memory=mem, kv_cache_dtype="float16", kv_cache_prefault=True),
                      loaded=loaded)
    k = eager.runner.kv_caches[-1][1]
    assert _mapping(k.data_ptr())["Rss"] * 1024 >= k.numel() * k.element_size()
    assert _mapping(lazy.runner.kv_caches[-1][1].data_ptr())["Rss"] == 0
    assert _greedy(lazy, 8) == _greedy(eager, 8)
    with pytest.raises(InvalidParameterError, match="kv_cache_prefault"):
        EngineConfig(kv_cache_prefault="yes")
