"""Prompt logprobs: the log-probability the model gives each prompt token, from the hidden states of the prompt
positions before it (vLLM's ``SamplingParams.prompt_logprobs``).

The hidden state at prompt position ``p`` gives the distribution of the token at ``p + 1``; so a prefill chunk over
positions ``[start, start + n)`` scores the prompt tokens ``[start + 1, min(start + n, P - 1) + 1)`` of a prompt of
``P`` tokens (the last position's logits sample the first output token instead). Logprobs are ``log_softmax`` of the
raw fp32 logits, as the sampler's (no penalty, temperature or truncation).

Only requests that ask pay: their prompt rows' logits are computed here, in blocks of ``LOGITS_BLOCK`` rows aligned
to absolute prompt positions (position ``p`` is always row ``p % LOGITS_BLOCK`` of the block of ``p // LOGITS_BLOCK``,
the rows a chunk does not cover zero-filled): a BLAS GEMM of a fixed shape gives a row the same bits whatever the
other rows hold, but a row's result can change with M or with its place in the call (OpenBLAS), so this keeps a
prompt token's logits independent of how the prompt was chunked and of the batch, at one weight read per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from leanserve.model.llama import LlamaModel
from leanserve.worker.sampler import TokenLogprobs

import torch

LOGITS_BLOCK = 32  # prompt positions per logits GEMM (the [rows, vocab] float32 buffers held at once)


@dataclass
class PromptLogprobsChunk:
    """Logprobs of consecutive prompt tokens.

    Attributes:
        start: prompt position of the first token scored (>= 1: the first prompt token has no logprob).
        entries: one per token from ``start`` on: the prompt token, its logprob and rank, and the top-N.
    """

    start: int
    entries: list[TokenLogprobs]


def prompt_rows(num_computed: int, num_new: int, num_prompt: int) -> range:
    """Positions of a step's chunk ``[num_computed, num_computed + num_new)`` whose logits score a prompt token:
    those before the prompt's last position (empty for a decode or a prompt of one token)."""
    return range(num_computed, max(num_computed, min(num_computed + num_new, num_prompt - 1)))


@torch.inference_mode()
def compute_prompt_logprobs(model: LlamaModel, hidden: torch.Tensor, first_position: int, targets: list[int],
                            num_top: int) -> list[TokenLogprobs]:
    """Logprobs of ``targets`` under the logits of ``hidden``.

    Args:
        model: gives the logits (``compute_logits``).
        hidden: ``[R, hidden]`` final hidden states of the R consecutive prompt positions from ``first_position``.
        first_position: prompt position of ``hidden``'s first row (places the rows in their logits blocks).
        targets: the R prompt tokens that follow those positions.
        num_top: most likely alternatives per token (0..20).

    Returns:
        R entries: ``logprob`` of the target (natural log of ``log_softmax`` of the fp32 logits), its ``rank``
        (1 + the number of tokens strictly more likely), and the ``num_top`` most likely ``(token_id, logprob)``,
        sorted descending.

    Raises:
        ValueError: ``hidden`` rows and ``targets`` differ in number.
    """
    if hidden.shape[0] != len(targets):
        raise ValueError(f"{hidden.shape[0]} hidden rows for {len(targets)} target tokens")
    out: list[TokenLogprobs] = []
    tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    end, b = first_position + len(targets), LOGITS_BLOCK
    for block in range(first_position // b * b, end, b):
        lo, hi = max(first_position, block), min(end, block + b)
        padded = hidden.new_zeros(b, hidden.shape[1])
        padded[lo - block:hi - block] = hidden[lo - first_position:hi - first_position]
        lp = torch.log_softmax(model.compute_logits(padded)[lo - block:hi - block], dim=-1)
        t = tgt[lo - first_position:hi - first_position].unsqueeze(1)
        chosen = lp.gather(1, t)
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        if num_top:
            top_v, top_i = lp.topk(num_top, dim=-1)
            tops = [list(zip(ids, vals, strict=True)) for ids, vals in zip(top_i.tolist(), top_v.tolist(),
                                                                           strict=True)]
        else:
            tops = [[] for _ in ranks]
        for tid, v, r, top in zip(t.squeeze(1).tolist(), chosen.squeeze(1).tolist(), ranks, tops, strict=True):
            out.append(TokenLogprobs(tid, v, r, top))
    return out
