"""Iteration-level scheduler (continuous batching, Yu et al., "Orca", OSDI 2022) with chunked prefill.

Every step forms one batch under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): first the running requests (decodes before unfinished prefill chunks), then waiting
requests, whose prompts may be split into chunks across steps. Each request is scheduled to catch its
``num_computed_tokens`` up with its ``num_tokens``. When blocks run out, the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later (its output so far is kept).

Long prompts do not stall the others (Sarathi-Serve, Agrawal et al., OSDI 2024; vLLM's partial-prefill knobs):
a prompt longer than ``long_prefill_token_threshold`` advances at most that many tokens per step, even when it is
alone, so one step stays short (a request that arrives, or a client that disconnects, waits at most one chunk);
at most ``max_long_partial_prefills`` such prompts are in prefill at once, and a long prompt that must wait keeps
its place but lets shorter requests behind it start.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from leanserve.core.kv_cache_manager import KVCacheManager, cdiv
from leanserve.core.request import Request, RequestStatus

# Prefill chunks of a request that asks for prompt logprobs are cut at multiples of this many tokens (but the last):
# the CPU attention sums a row's keys in SIMD vectors of up to 16 floats, and a chunk ending mid-vector rounds its
# last rows differently from a cold prefill; aligned chunks keep the prompt's logprobs bitwise the same whatever
# the step budget left them (tests/engine/test_prompt_logprobs.py).
PROMPT_LOGPROBS_CHUNK_MULTIPLE = 16


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on (drafts included)
    block_ids: list[int]  # the request's block table after allocation
    # draft tokens verified after the request's pending token (a decode of 1 + len(spec_token_ids) rows)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so a new token is sampled."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == req.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the last step: drop their state
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class StepResult:
    """A request's progress after a step (consumed by the engine's output processor)."""

    request: Request
    new_token_ids: list[int]  # the sampled token, or the accepted drafts and the one after them
    finished: bool
    num_draft_tokens: int = 0  # drafts verified in this step
    num_accepted_tokens: int = 0  # of which accepted (they are new_token_ids[:num_accepted_tokens])


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes.

    Args:
        kv: the KV cache manager.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget of one step (None: unlimited).
        max_model_len: longest sequence, prompt + output, in tokens.
        policy: "fcfs" (default) or "priority" (lower ``Request.priority`` first, then arrival).
        long_prefill_token_threshold: prompts longer than this (tokens) are "long" and advance at most this many
            tokens per step; None: no limit.
        max_long_partial_prefills: long prompts allowed in prefill at the same time.
        min_chunk_tokens: prefill chunks are not cut shorter than this, nor leave a shorter last piece, unless the
            budget forces it (a piece of only a few tokens would round differently from a longer chunk).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int | None,
                 max_model_len: int, policy: str = "fcfs", long_prefill_token_threshold: int | None = None,
                 max_long_partial_prefills: int = 1, min_chunk_tokens: int = 1) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}; use 'fcfs' or 'priority'")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_long_partial_prefills = max_long_partial_prefills
        self.min_chunk_tokens = min_chunk_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._admissions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queue a request. Invariant (checked by the engine's admission, asserted here): prompt + max_tokens fits
        the whole pool and ``max_model_len``, so a request alone can always be scheduled to its end."""
        assert cdiv(request.num_prompt_tokens + request.max_tokens, self.kv.block_size) <= self.kv.num_blocks, \
            f"request {request.request_id} cannot fit the KV pool: admission must refuse it"
        assert request.num_prompt_tokens + request.max_tokens <= self.max_model_len, \
            f"request {request.request_id} exceeds max_model_len: admission must refuse it"
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            key = (request.priority, request.arrival_time)
            i = 0
            while i < len(self.waiting) and (self.waiting[i].priority, self.waiting[i].arrival_time) <= key:
                i += 1
            self.waiting.insert(i, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def schedule(self) -> SchedulerOutput:
        """Form the next step's batch (may preempt running requests)."""
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else 1 << 62
        scheduled: set[str] = set()
        # Running requests: decodes first, then unfinished prefill chunks, each in admission order.
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.admitted_seq))
        for idx, req in enumerate(order):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget, self._multiple(req))
            if num_new == 0:
                continue  # its next chunk waits for a step with room
            spec = self._drafts(req, budget, reserve=len(order) - idx - 1) if num_new == 1 else []
            if spec and not self.kv.allocate_slots(req, 1 + len(spec)):
                spec = []  # no room for the drafts: a plain decode (no preemption for speculation)
            num_new += len(spec)
            while not self.kv.allocate_slots(req, num_new):
                victim = max((r for r in self.running if r.request_id not in scheduled),
                             key=lambda r: r.admitted_seq)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id), spec))
            scheduled.add(req.request_id)
            budget -= num_new
        if out.num_preempted:
            return out  # no admissions in a step that had to preempt
        # Waiting requests: a prompt that does not fit now is skipped, so smaller ones behind it still start.
        skipped: list[Request] = []
        num_long = sum(1 for r in self.running if self._is_long(r.num_tokens - r.num_computed_tokens))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit_tokens
            if self._is_long(remaining) and num_long >= self.max_long_partial_prefills:
                skipped.append(req)  # another long prompt is prefilling: let shorter requests pass
                continue
            num_new = self._chunk(remaining, budget, self._multiple(req))
            if num_new == 0 or not self.kv.allocate_slots(req, num_new, hits):
                skipped.append(req)
                continue
            num_long += self._is_long(remaining)
            if req.first_scheduled_time is None:
                req.num_cached_tokens = num_hit_tokens
                req.first_scheduled_time = time.monotonic()
                self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self._admissions += 1
            req.admitted_seq = self._admissions
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            budget -= num_new
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        return out

    def _drafts(self, req: Request, budget: int, reserve: int) -> list[int]:
        """The request's drafts that fit: the step budget, the context (positions < max_model_len), what is left of
        max_tokens (a run never yields more tokens than the request may still have), and the free blocks, keeping
        ``reserve`` blocks for the running requests still to schedule (drafts never cause a preemption)."""
        if not req.spec_token_ids:
            return []
        left = min(budget - 1, self.max_model_len - req.num_tokens - 1, req.max_tokens - len(req.output_token_ids) - 1)
        k = min(len(req.spec_token_ids), max(0, left))
        bs, held = self.kv.block_size, len(self.kv.block_ids(req.request_id))
        while k and cdiv(req.num_tokens + k, bs) - held > self.kv.pool.num_free_blocks - reserve:
            k -= 1
        return req.spec_token_ids[:k]

    def _is_long(self, remaining: int) -> bool:
        threshold = self.long_prefill_token_threshold
        return threshold is not None and remaining > threshold

    @staticmethod
    def _multiple(req: Request) -> int:
        return PROMPT_LOGPROBS_CHUNK_MULTIPLE if req.sampling_params.prompt_logprobs is not None else 1

    def _chunk(self, remaining: int, budget: int, multiple: int = 1) -> int:
        """Tokens to compute now for a request with ``remaining`` uncomputed tokens and ``budget`` left in the
        step; a piece that does not finish is cut to a multiple of ``multiple`` when that leaves one. 0 (not this
        step) where the budget left would give a piece shorter than ``min_chunk_tokens`` that does not finish the
        request, unless the whole step budget is that short: a short piece would round differently from a chunk, so
        a prompt's numbers would depend on the other requests of its steps."""
        n = min(remaining, budget)
        if self._is_long(n):
            n = self.long_prefill_token_threshold
        left = remaining - n
        if 0 < left < self.min_chunk_tokens:  # no short last piece
            if remaining <= budget:
                n = remaining  # finish now, a little over the long-prompt threshold
            elif n - (self.min_chunk_tokens - left) >= self.min_chunk_tokens:
                n -= self.min_chunk_tokens - left
        if n < remaining and n // multiple * multiple >= self.min_chunk_tokens:
            n = n // multiple * multiple
        full = self.max_num_batched_tokens
        if n < min(remaining, self.min_chunk_tokens) and (full is None or full >= self.min_chunk_tokens):
            return 0  # the step's other requests left only a short piece: wait for a step with room for a chunk
        return n

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[StepResult]:
        """Advance the scheduled requests by the step's results.

        Args:
            out: the step's schedule.
            sampled: request_id -> the sampled token id, or for a request that verified drafts the accepted drafts
                followed by one more token; for requests whose step reached the end of their tokens.

        Tokens are appended one at a time and each is checked against EOS, stop ids, max_tokens and the context, so
        a stop inside an accepted run ends the request there. The KV of rejected drafts is rolled back
        (``num_computed_tokens`` counts only accepted positions) before full blocks are cached, so no cached block
        holds a rejected draft.

        Returns:
            One :class:`StepResult` per request that sampled a token (finished ones included).
        """
        now = time.monotonic()
        results = []
        for s in out.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id)
            num_spec = len(s.spec_token_ids)
            if tokens is None:
                req.num_computed_tokens += s.num_new_tokens - num_spec
                self.kv.cache_blocks(req)
                continue
            tokens = [tokens] if isinstance(tokens, int) else tokens
            assert 1 <= len(tokens) <= num_spec + 1 and tokens[:-1] == s.spec_token_ids[:len(tokens) - 1], \
                f"request {req.request_id}: {tokens} do not extend its drafts {s.spec_token_ids}"
            num_accepted = len(tokens) - 1
            # the pending token and the accepted drafts are computed; rejected drafts' KV is overwritten later
            req.num_computed_tokens += s.num_new_tokens - num_spec + num_accepted
            req.spec_token_ids = []
            req.num_draft_tokens += num_spec
            req.num_accepted_tokens += num_accepted
            new_tokens: list[int] = []
            status = None
            for token in tokens:
                req.output_token_ids.append(token)
                new_tokens.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            # a stop inside the run: the KV of accepted drafts after it belongs to no token of the output
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv.cache_blocks(req)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if status is not None:
                self._finish(req, status)
            results.append(StepResult(req, new_tokens, req.is_finished, num_spec, num_accepted))
        return results

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH  # a hard limit, even before min_tokens
        if len(req.output_token_ids) < params.min_tokens:
            return None
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside (abort, or a stop string found by the detokenizer); frees its blocks.

        Returns:
            The request, or None when it is unknown or already finished.
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, status)
        return req
