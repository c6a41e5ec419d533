"""The scheduler's view of one request: its tokens, progress, status and timestamps (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from leanserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request. Finished states map to OpenAI ``finish_reason`` via :attr:`finish_reason`."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" for a finished request, else None."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """One sequence being generated (a choice of an ``n > 1`` request is its own Request).

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; each step the scheduler lets it catch up
    with ``num_tokens`` (prompt + output). Prefill, chunked prefill, prefix hits and recompute after preemption
    all follow from that one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved limit on output tokens
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS / end-of-turn ids (ignored with ignore_eos)
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, time.monotonic clock
    priority: int = 0  # lower runs first when the scheduler uses priority policy
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    admitted_seq: int = 0  # scheduler's admission counter (preemption picks the newest)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    # speculative decoding: draft tokens to verify in the next decode step (set by the engine before scheduling)
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_at(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
