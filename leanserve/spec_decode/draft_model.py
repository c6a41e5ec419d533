"""Drafts from a second, cheaper model with the target's vocabulary (Leviathan et al. 2023; vLLM's
``draft_model`` method), e.g. the target's own GGUF file at 4 bits drafting for the unquantized target.

The draft model's KV cache has the target's block layout and is indexed by the target's block tables, so it is
allocated, freed, preempted and shared with the request's own blocks, with no bookkeeping of its own beyond how
far each request's draft KV is valid. Its drafts are greedy (argmax), so the draft distribution q is one-hot and
the runner's one-hot acceptance keeps the target's distribution exactly (see
:mod:`leanserve.worker.rejection_sampler`).

Per step, for the requests the scheduler gave lookahead slots: the draft first catches up on the tokens its KV
lacks (the pending token and the drafts accepted in the last step; the whole prompt the first time or after a
preemption), which yields the first draft, then runs one batched decode per further draft. A draft written at a
position the target rejects is overwritten later: only positions below the target's ``num_computed_tokens`` are
trusted.

A self-draft (the target's own file at fewer bits) shares the target's KV cache instead (:func:`shares_kv_cache`):
no second cache, no prefill of its own, and a catch-up of the pending token alone, a one-row decode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from leanserve.config import ModelConfig
from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest
from leanserve.errors import InvalidParameterError
from leanserve.model.llama import LlamaModel
from leanserve.worker.model_runner import ModelRunner

import torch


def shares_kv_cache(requested: bool | None, target_path: str, target: ModelConfig, draft_path: str,
                    draft: ModelConfig) -> bool:
    """Whether the draft model reads and writes the target's KV cache (``speculative_config.share_kv_cache``).

    None (the default) shares when the draft is the target's own file: its K/V projections are the target's, so the
    target's cached K/V is what the draft would compute up to the rounding of its own weights, and the draft needs
    neither a prefill of its own nor a second cache. True shares whenever the layer and head shapes match (the
    drafts of a different model then read the target's K/V: they stay correct, since the target verifies every
    token, but are likelier to be rejected).

    Raises:
        InvalidParameterError: True for a draft whose layers, KV heads or head size differ from the target's.
    """
    shapes = (target.num_layers, target.num_kv_heads, target.head_dim) == \
        (draft.num_layers, draft.num_kv_heads, draft.head_dim)
    if requested is None:
        return shapes and os.path.realpath(target_path) == os.path.realpath(draft_path)
    if requested and not shapes:
        raise InvalidParameterError(
            "speculative_config.share_kv_cache", f"the draft's KV cache shape (layers, KV heads, head size) "
            f"{(draft.num_layers, draft.num_kv_heads, draft.head_dim)} differs from the target's "
            f"{(target.num_layers, target.num_kv_heads, target.head_dim)}: it cannot share the target's cache")
    return requested


# A catch-up of more tokens than this runs as a prefill chunk; fewer run as decode rows of consecutive positions.
CATCH_UP_DECODE_ROWS = 8


@dataclass
class _DraftView:
    """What :meth:`ModelRunner.build_inputs` reads of a request: its tokens (the request's own, then this step's
    drafts, read in place: no copy of the context) and how many of them have draft KV."""

    request: Request
    num_computed_tokens: int
    drafts: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def num_prompt_tokens(self) -> int:  # rows past it in a chunk run as decode rows (recomputed_rows)
        return self.request.num_prompt_tokens

    def token_at(self, start: int, end: int) -> list[int]:
        n = self.request.num_tokens
        head = self.request.token_at(start, min(end, n)) if start < n else []
        return head + self.drafts[max(0, start - n):max(0, end - n)]


class DraftModelProposer:
    """Greedy drafts of ``model`` over its own KV caches (laid out like the target's).

    Args:
        model: the draft decoder (same vocabulary as the target).
        kv_caches: its per-layer caches, ``[num_blocks, block_size, ...]`` with the target's num_blocks: its own,
            or the target's caches themselves when ``shares_target_cache``.
        block_size: tokens per block (the target's).
        use_native_kernels: use the compiled decode attention where it applies.
        shares_target_cache: ``kv_caches`` are the target's (see :func:`shares_kv_cache`). The draft then reads the
            target's K/V of every computed position (prompt, prefix-cache hits, accepted tokens) and catches up on
            the pending token only; it writes its K/V at positions from the target's ``num_computed_tokens`` on,
            the lookahead slots that the target's verification of the same step overwrites with its own K/V
            before anything reads them.
    """

    def __init__(self, model: LlamaModel, kv_caches: list, block_size: int, use_native_kernels: bool = True,
                 shares_target_cache: bool = False) -> None:
        self.model = model
        self.runner = ModelRunner(model, kv_caches, block_size, sampler=None, use_native_kernels=use_native_kernels)
        self.shares_target_cache = shares_target_cache
        self._valid: dict[str, tuple[int, int]] = {}  # request id -> (its num_preemptions, draft KV positions)

    def reset(self, request_id: str) -> None:
        """Forget a request (it ended)."""
        self._valid.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, items: list[tuple[Request, list[int], int]]) -> list[list[int]]:
        """``k`` greedy drafts for each (request, its block table, k) after its pending token, in ``items`` order.

        The request's blocks must hold slots up to position ``num_tokens - 1 + k`` (the scheduler's lookahead).
        """
        views = []
        for req, _, _ in items:
            seen = self._valid.get(req.request_id)
            if self.shares_target_cache:
                valid = req.num_computed_tokens  # the target's K/V
            elif seen is None or seen[0] != req.num_preemptions:
                valid = 0
            else:
                valid = min(seen[1], req.num_computed_tokens)
            views.append(_DraftView(req, valid))
        drafts = [v.drafts for v in views]
        active = [i for i, (_, _, k) in enumerate(items) if k > 0]
        while active:
            batch = []
            for i in active:
                v, blocks = views[i], items[i][1]
                m = v.num_tokens - v.num_computed_tokens
                if m <= CATCH_UP_DECODE_ROWS:  # one decode row per position
                    tail = v.token_at(v.num_computed_tokens + 1, v.num_tokens)
                    batch.append((i, ScheduledRequest(v, m, blocks, tail)))
                else:
                    batch.append((i, ScheduledRequest(v, m, blocks)))
            batch.sort(key=lambda x: x[1].num_new_tokens - len(x[1].spec_token_ids) != 1)  # decodes first
            input_ids, positions, meta, _ = self.runner.build_inputs([s for _, s in batch])
            hidden = self.model.forward(input_ids, positions, self.runner.kv_caches, meta)
            last, row = [], 0
            for _, s in batch:
                row += s.num_new_tokens
                last.append(row - 1)
            logits = self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])
            for (i, _), token in zip(batch, logits.argmax(dim=-1).tolist(), strict=True):
                v = views[i]
                v.num_computed_tokens = v.num_tokens
                v.drafts.append(token)
            active = [i for i in active if len(drafts[i]) < items[i][2]]
        for (req, _, _), v in zip(items, views, strict=True):
            self._valid[req.request_id] = (req.num_preemptions, v.num_computed_tokens)
        return drafts
