"""Batched sampler: turns one step's logits into one token per request, plus optional logprobs.

Order of operations (as vLLM's v1 sampler):

1. logprobs come from the *raw* logits: ``log_softmax`` of the model's output, before any penalty,
   temperature or truncation (vLLM's default ``logprobs_mode="raw_logprobs"``);
2. min_tokens: the EOS/stop token ids are set to -inf while fewer than ``min_tokens`` were generated;
3. repetition penalty over prompt + output tokens (HF ``RepetitionPenaltyLogitsProcessor`` / vLLM, CTRL
   paper eq. 3: a positive logit is divided by the penalty, a negative one multiplied);
4. presence / frequency penalties over output tokens (OpenAI API reference, "frequency and presence
   penalties": ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``);
5. structured outputs: the grammar's token bitmask sets forbidden tokens to -inf (rows that have one);
6. greedy rows take the argmax; sampled rows: temperature, softmax, top-k, top-p, min-p, then one draw
   from the row's own ``torch.Generator``.

A draw takes one uniform number per row (inverse CDF: the first token whose cumulative probability
exceeds ``u * total``), so a seeded request's tokens depend neither on the rest of the batch nor on its
position in it. On CPU a full-vocabulary sort per row is slow and torch's ``argmax``/``topk``/``cumsum`` are
scalar loops while ``amax``/``sum`` are vectorized, so top-k/top-p/min-p use one cut per row found among
``topk`` candidates, and argmax, topk and the inverse CDF go through blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leanserve.sampling_params import SamplingParams
from leanserve.structured.grammar import apply_token_bitmask

import torch

_WIDTHS = (64, 512, 4096)  # candidate widths tried for top-k/top-p/min-p before the whole vocab
_BLOCK = 1024  # largest block of the two-level argmax, topk and inverse CDF


@dataclass
class SamplingState:
    """One row of the batch being sampled.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: prompt token ids (list, array or tensor; for the repetition penalty).
        output_token_ids: ids generated so far (penalties, min_tokens).
        generator: the request's own CPU RNG; None only for greedy rows (a sampled row without one
            falls back to torch's global generator).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token, from the raw logits (natural log, <= 0).

    Attributes:
        token_id: the chosen token.
        logprob: its log-probability under ``log_softmax(raw logits)``.
        rank: 1 + the number of tokens strictly more likely than it (1 = most likely).
        top: the ``params.logprobs`` most likely ``(token_id, logprob)`` pairs, sorted descending.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """Result of one sampler call, one entry per row, in the order of the states.

    Attributes:
        token_ids: the chosen token of each row.
        logprobs: per row, its logprobs, or None where ``params.logprobs`` is None.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row from a step's logits.

    Args:
        stop_token_ids: the model's EOS / end-of-turn ids; with each request's own
            ``params.stop_token_ids`` they are masked (-inf) while ``len(output) < min_tokens``
            (also with ``ignore_eos``, as vLLM).
        argmax_kernel: a native ``x.argmax(-1)`` for float32 CPU rows (first of ties, first NaN), or None.
    """

    def __init__(self, stop_token_ids: frozenset[int],
                 argmax_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)
        # greedy rows of CPU logits: ``argmax_kernel(x [n, m] float32) -> [n] int64`` equal to ``x.argmax(-1)``
        # (leanserve.kernels' argmax_rows: one pass on the calling thread); None: the blocked torch argmax
        self.argmax_kernel = argmax_kernel
        # Reused [rows, vocab] float32 work buffers: on CPU a fresh multi-MB tensor per op costs more in
        # page faults than the op itself (softmax(x / t) takes ~5x longer than into a reused buffer).
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, states: list[SamplingState],
                 token_bitmask: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        """Pick the next token of every row.

        Args:
            logits: ``[num_reqs, vocab]`` float32 or bfloat16 (cast to float32; never modified).
            states: ``num_reqs`` rows, in the order of the logits' rows.
            token_bitmask: structured outputs: ``(bitmask, rows)``, a ``[num_reqs, ceil(vocab / 32)]`` int32
                bitmask (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed) applied to the listed rows
                only, after the penalties and before the draw.

        Returns:
            the chosen ids and, for rows that asked, their logprobs from the raw logits.

        Raises:
            ValueError: if ``logits`` is not 2-D or its row count differs from ``len(states)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(states)} states")
        num = logits.shape[0]
        x = logits.to(torch.float32).contiguous()
        params = [s.params for s in states]
        rows = range(num)
        mask_rows = [i for i in rows if len(states[i].output_token_ids) < params[i].min_tokens]
        rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        pf_rows = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
        g_rows = token_bitmask[1] if token_bitmask is not None else []
        work = self._buf("work", x).copy_(x) if mask_rows or rep_rows or pf_rows or g_rows else x  # x stays raw
        self._mask_stop_tokens(work, mask_rows, states)
        if rep_rows:
            _repetition_penalty(work, rep_rows, states)
        if pf_rows:
            _presence_frequency_penalty(work, pf_rows, states)
        if g_rows:
            apply_token_bitmask(work, token_bitmask[0], g_rows)

        greedy = [i for i in rows if params[i].is_greedy]
        sampled = [i for i in rows if not params[i].is_greedy]
        argmax = self.argmax_kernel if self.argmax_kernel is not None and x.device.type == "cpu" else _argmax
        if not sampled and all(p.logprobs is None for p in params):  # the common greedy step: no tensor round trip
            return SamplerOutput(argmax(work).tolist(), [None] * num)
        tokens = torch.empty(num, dtype=torch.long, device=x.device)
        if greedy:
            tokens[greedy] = argmax(self._rows(work, greedy))
        if sampled:
            tokens[sampled] = self._sample(self._rows(work, sampled), [states[i] for i in sampled])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(x, tokens, token_ids, params))

    def _buf(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A reused float32 buffer of ``like``'s 2-D shape (contents undefined)."""
        n, m = like.shape
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != m or buf.device != like.device:
            buf = self._bufs[name] = torch.empty(n, m, device=like.device)
        return buf[:n]

    def _rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``x[rows]`` (into a reused buffer), or ``x`` itself when ``rows`` is every row in order."""
        if len(rows) == x.shape[0]:
            return x
        idx = torch.tensor(rows, device=x.device)
        return torch.index_select(x, 0, idx, out=self._buf("rows", x[: len(rows)]))

    def _mask_stop_tokens(self, x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
        """min_tokens: set the stop ids of ``rows`` of ``x`` to -inf, in place."""
        for i in rows:
            ids = [t for t in self.stop_token_ids.union(states[i].params.stop_token_ids) if t < x.shape[1]]
            if ids:
                x[i, ids] = float("-inf")

    def _logprobs(
        self, x: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], params: list[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        """Per row, the chosen token's logprob, rank and top-N under ``log_softmax(x)`` (raw logits)."""
        out: list[TokenLogprobs | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        raw = self._rows(x, rows)
        lp = torch.log_softmax(raw, dim=-1, out=self._buf("logprobs", raw))
        chosen = lp.gather(1, tokens[rows].unsqueeze(1))
        top_v, top_i = _topk(lp, max(1, *(params[i].logprobs for i in rows)))
        # Every token above the chosen one is in the top list when the chosen one is not below its end.
        inside = chosen.squeeze(1) >= top_v[:, -1]
        ranks = torch.where(inside, (top_v > chosen).sum(dim=-1), 0)
        if not bool(inside.all()):
            ranks[~inside] = (lp[~inside] > chosen[~inside]).sum(dim=-1)
        ranks, chosen, top_v, top_i = (ranks + 1).tolist(), chosen.squeeze(1).tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            top = list(zip(top_i[j][: params[i].logprobs], top_v[j][: params[i].logprobs], strict=True))
            out[i] = TokenLogprobs(token_ids[i], chosen[j], ranks[j], top)
        return out

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """``[rows]`` long ids drawn from ``[rows, vocab]`` float32 penalized ``logits`` (not modified):
        temperature, softmax, top-k / top-p / min-p, then one inverse-CDF draw per row (none greedy)."""
        rows, vocab = logits.shape
        dev = logits.device
        params = [s.params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        scaled = torch.div(logits, temperature, out=self._buf("scaled", logits))
        probs = torch.softmax(scaled, dim=-1, out=self._buf("probs", logits))
        # One uniform per row from the row's own generator: the draw does not depend on the batch.
        u = [torch.rand((), dtype=torch.float64, generator=s.generator).item() for s in states]
        u = torch.tensor(u, dtype=torch.float64, device=dev)
        out = torch.empty(rows, dtype=torch.long, device=dev)
        is_trunc = [0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
        plain = [i for i in range(rows) if not is_trunc[i]]
        if plain:
            out[plain] = _inverse_cdf(_take(probs, plain), u[plain])
        trunc = [i for i in range(rows) if is_trunc[i]]
        if trunc:
            tokens, cut = _truncate(_take(probs, trunc), [params[i] for i in trunc], u[trunc])
            out[trunc] = tokens
            left = (tokens < 0).nonzero().flatten().tolist()  # kept sets wider than the candidates
            if left:
                sub = probs[[trunc[j] for j in left]]
                sub.masked_fill_(sub < cut[left].unsqueeze(1), 0.0)
                out[[trunc[j] for j in left]] = _inverse_cdf(sub, u[[trunc[j] for j in left]])
        return out


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, without the copy when ``rows`` is every row in order (then ``x`` itself)."""
    return x if len(rows) == x.shape[0] else x[rows]


def _flat_tokens(rows: list[int], seqs: list[list[Sequence[int]]], device: torch.device) -> tuple:
    """``(row_idx, token_ids, lengths)`` long tensors: every id of ``seqs[i]``'s sequences, tagged ``rows[i]``."""
    parts = [torch.as_tensor(s, dtype=torch.long).flatten() for group in seqs for s in group]
    lengths = torch.tensor([t.numel() for t in parts], dtype=torch.long).view(len(seqs), -1).sum(dim=1)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return row_idx.to(device), torch.cat(parts).to(device), lengths.to(device)


def _repetition_penalty(x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
    """In place: the logit ``l`` of each prompt/output token becomes ``l / p`` if ``l > 0`` else ``l * p``."""
    seqs = [[states[i].prompt_token_ids, states[i].output_token_ids] for i in rows]
    row_idx, tokens, lengths = _flat_tokens(rows, seqs, x.device)
    pen = torch.tensor([states[i].params.repetition_penalty for i in rows], device=x.device)
    pen = torch.repeat_interleave(pen, lengths)
    vals = x[row_idx, tokens]
    # Duplicate (row, token) pairs write the same value, so the scatter is deterministic.
    x[row_idx, tokens] = torch.where(vals > 0, vals / pen, vals * pen)


def _presence_frequency_penalty(x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
    """In place, over output tokens: ``l[j] -= count[j] * frequency + (count[j] > 0) * presence``."""
    row_idx, tokens, _ = _flat_tokens(rows, [[states[i].output_token_ids] for i in rows], x.device)
    vocab = x.shape[1]
    keys, counts = torch.unique(row_idx * vocab + tokens, return_counts=True)
    freq, pres = torch.zeros(x.shape[0], device=x.device), torch.zeros(x.shape[0], device=x.device)
    freq[rows] = torch.tensor([states[i].params.frequency_penalty for i in rows], device=x.device)
    pres[rows] = torch.tensor([states[i].params.presence_penalty for i in rows], device=x.device)
    x.view(-1)[keys] -= freq[keys // vocab] * counts + pres[keys // vocab]


def _truncate(probs: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, top-p and min-p as one probability cut per row of ``probs`` (``[n, vocab]`` float32 softmax
    rows, not modified); samples (with ``u``, ``[n]`` float64) the rows whose kept set is small.

    A row keeps the tokens with ``probs >= cut``: the k most likely (top-k), of those the fewest most likely
    whose share reaches ``top_p`` (HF ``TopPLogitsWarper`` / vLLM: a token goes when the tokens before it
    already hold ``top_p``), and of those the ones with at least ``min_p`` times the top probability; ties
    of the cut are kept. The cut is found among the row's ``topk(width)`` candidates, widening through
    ``_WIDTHS`` (then the vocab) while a row needs more. A row whose kept set lies inside its candidates is
    sampled there, in token-id order. Every decision depends on the row alone.

    Returns:
        ``(tokens, cut)``: ``[n]`` long (-1 where the caller must sample) and ``[n]`` float32 cuts.
    """
    n, vocab = probs.shape
    dev = probs.device
    tokens, cuts = torch.full((n,), -1, dtype=torch.long, device=dev), torch.zeros(n, device=dev)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    pending = list(range(n))
    for width in (*(w for w in _WIDTHS if w < vocab), vocab):
        now = [j for j in pending if ks[j] < width or width == vocab]
        if not now:
            continue
        vals, idx = _topk(_take(probs, now), width)  # sorted descending
        last, now_t = vals[:, -1], torch.tensor(now, dtype=torch.long, device=dev)
        k = torch.tensor([ks[j] or width for j in now], device=dev)
        has_k = k < width
        cut_k = torch.where(has_k, vals.gather(1, (k - 1).unsqueeze(1)).squeeze(1), 0.0)
        cum = torch.where(vals >= cut_k.unsqueeze(1), vals, 0.0).cumsum(dim=-1)
        top_p = torch.tensor([params[j].top_p for j in now], device=dev)
        has_p = top_p < 1.0
        top_p = top_p * torch.where(has_k, cum[:, -1], 1.0)  # a share of what top-k kept
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass of earlier tokens
        # at least the most likely token (a top_p that rounds to 0 in float32 keeps one, as HF's min_tokens_to_keep)
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
        cut_p = torch.where(has_p, vals.gather(1, n_keep - 1).squeeze(1), 0.0)
        min_p = torch.tensor([params[j].min_p for j in now], device=dev) * vals[:, 0]
        cut = torch.maximum(torch.maximum(cut_k, cut_p), min_p)
        # Resolved: top-k's ties do not spill past the candidates, which hold top_p of the mass.
        resolved = (~has_k | (last < cut_k)) & (~has_p | (cum[:, -1] >= top_p)) | (width == vocab)
        fits = resolved & ((last < cut) | (width == vocab))
        cuts[now_t[resolved]] = cut[resolved]
        if fits.any():
            order = idx[fits].argsort(dim=-1)  # token-id order: independent of topk's order of ties
            cand = torch.where(vals[fits] >= cut[fits].unsqueeze(1), vals[fits], 0.0).gather(1, order)
            pos = _inverse_cdf(cand, u[now_t[fits]])
            tokens[now_t[fits]] = idx[fits].gather(1, order).gather(1, pos.unsqueeze(1)).squeeze(1)
        finished = {j for j, r in zip(now, resolved.tolist(), strict=True) if r}
        pending = [j for j in pending if j not in finished]
        if not pending:
            break
    return tokens, cuts


@functools.lru_cache(maxsize=64)
def _block(m: int, limit: int) -> int | None:
    """The largest divisor of ``m`` in [16, limit] (a block size needing no padding), else None."""
    return next((d for d in range(min(limit, m), 15, -1) if m % d == 0), None)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of ``[n, m]`` float32 (first of ties): the first block holding the maximum
    (block maxima by the vectorized ``amax``), then the first maximum in that block."""
    n, m = x.shape
    block = _block(m, _BLOCK)
    if block is None or m < 4 * block:
        return x.argmax(dim=-1)
    blocks = x.view(n, m // block, block)
    b = blocks.amax(dim=-1).argmax(dim=-1)
    return b * block + blocks[torch.arange(n, device=x.device), b].argmax(dim=-1)


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(min(k, m), -1)`` (values sorted descending, indices) of ``[n, m]`` float32, via the k blocks
    with the largest maxima, which hold the k largest values (the order of tied indices may differ)."""
    n, m = x.shape
    k = min(k, m)
    block = _block(m, min(_BLOCK, m // (4 * k)))
    if block is None:
        return x.topk(k, dim=-1)
    blocks = x.view(n, m // block, block)
    top_b = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [n, k]
    cand = blocks.gather(1, top_b.unsqueeze(2).expand(n, k, block)).view(n, k * block)
    vals, j = cand.topk(k, dim=-1)
    return vals, top_b.gather(1, j // block) * block + j % block


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of unnormalized ``probs`` ``[n, m]`` (>= 0) with uniforms ``u`` ``[n]``
    (float64): the first index whose cumulative sum exceeds ``u * total``, so never a zero entry. Wide rows
    go in two levels (block sums, then a cumsum inside one block), faster than a full cumsum on CPU."""
    n, m = probs.shape
    block = _block(m, _BLOCK)
    if block is None or m <= 4 * block:
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1].double()).float().unsqueeze(1)
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=m - 1).squeeze(1)
    else:
        blocks = probs.view(n, m // block, block)
        bcdf = blocks.sum(dim=-1).cumsum(dim=-1)
        target = (u * bcdf[:, -1].double()).float().unsqueeze(1)
        b = torch.searchsorted(bcdf, target, right=True).clamp_(max=bcdf.shape[1] - 1)
        target -= torch.where(b > 0, bcdf.gather(1, (b - 1).clamp(min=0)), 0.0)
        in_block = blocks[torch.arange(n, device=probs.device), b.squeeze(1)].cumsum(dim=-1)
        j = torch.searchsorted(in_block, target, right=True).clamp_(max=block - 1)
        idx = (b * block + j).squeeze(1)
    # Rounding can put the target past the last positive entry (of the row or block): step back to it.
    for r in (probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0).nonzero().flatten().tolist():
        nz = probs[r, : int(idx[r]) + 1].nonzero()
        nz = nz if len(nz) else probs[r].nonzero()
        if len(nz):
            idx[r] = nz[-1, 0]
    return idx
