"""Perplexity and continuation log-likelihood of a :class:`LlamaModel`, run through the paged KV cache.

Each window of text is fed in chunks (``chunk`` tokens at a time); every chunk after the first attends to the
earlier ones through the KV cache, so a quantized KV cache affects the score as it would in serving.
Perplexity = exp(mean negative log-likelihood of each token given the earlier tokens of its window).
"""

from __future__ import annotations

import math
from importlib import resources

from leanserve.model.attention import AttentionMetadata, KVCache, PrefillChunk
from leanserve.model.llama import LlamaModel
from leanserve.worker.model_runner import allocate_kv_cache

import torch

BLOCK_SIZE = 16


def default_text() -> str:
    """The bundled perplexity text: ~40k characters of the Python Language Reference (PSF license; see
    ``leanserve/tools/data/SOURCE.md``)."""
    return resources.files("leanserve.tools").joinpath("data/python_reference.txt").read_text(encoding="utf-8")


@torch.inference_mode()
def token_logprobs(model: LlamaModel, ids: list[int], kv_cache_dtype: str = "auto", chunk: int = 128,
                   kv_caches: list[tuple[KVCache, KVCache]] | None = None) -> torch.Tensor:
    """Log-probability of each token of ``ids`` given the tokens before it: [len(ids) - 1] float32 (nats).

    Args:
        model: the decoder. ids: one sequence of token ids (>= 2 tokens).
        kv_cache_dtype: "auto" or "int8" (allocated here unless ``kv_caches`` is given).
        chunk: tokens per forward pass (later chunks read the earlier ones from the cache).
        kv_caches: a cache with at least ``ceil(len(ids) / 16)`` blocks of 16 tokens, reused across calls.

    Raises:
        ValueError: fewer than 2 tokens.
    """
    n = len(ids)
    if n < 2:
        raise ValueError("need at least 2 tokens to score")
    num_blocks = -(-n // BLOCK_SIZE)
    caches = kv_caches or allocate_kv_cache(model, num_blocks, BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    block_ids = torch.arange(num_blocks)
    out = []
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)  # the last token is only a target
        pos = torch.arange(start, stop)
        mask = None
        if start:
            mask = torch.arange(stop)[None, :] <= pos[:, None]  # [q_len, start + q_len]
        meta = AttentionMetadata(slot_mapping=pos.clone(), prefills=[PrefillChunk(0, stop - start, start, block_ids,
                                                                                  mask)])
        hidden = model.forward(torch.tensor(ids[start:stop]), pos, caches, meta)  # [q_len, hidden]
        logp = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [q_len, vocab]
        out.append(logp.gather(1, torch.tensor(ids[start + 1:stop + 1])[:, None])[:, 0])
    return torch.cat(out)


def perplexity(model: LlamaModel, ids: list[int], window: int = 512, kv_cache_dtype: str = "auto",
               chunk: int = 128) -> float:
    """exp(mean NLL) over consecutive non-overlapping windows of ``window`` tokens of ``ids`` (each window scored
    from its own start, as ``llama-perplexity`` does per context)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        piece = ids[start:start + window]
        if len(piece) < 2:
            break
        lp = token_logprobs(model, piece, kv_cache_dtype, chunk)
        total -= float(lp.sum())
        count += lp.numel()
    return math.exp(total / count)


def continuation_logprob(model: LlamaModel, prompt_ids: list[int], continuation_ids: list[int],
                         kv_cache_dtype: str = "auto") -> float:
    """Total log-probability (nats) of ``continuation_ids`` after ``prompt_ids`` (for multiple-choice scoring).

    Raises:
        ValueError: an empty prompt or continuation.
    """
    if not prompt_ids or not continuation_ids:
        raise ValueError("prompt and continuation must be non-empty")
    lp = token_logprobs(model, prompt_ids + continuation_ids, kv_cache_dtype)
    return float(lp[len(prompt_ids) - 1:].sum())
