"""Results handed to users of the Python API and the server (field names follow vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (natural log, from the model's raw distribution)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds on the ``time.monotonic`` clock, and derived latencies."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this sequence
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until the first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: seconds from arrival (queueing included) to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """Seconds from the first scheduling to the first token."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first to the last output token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, in seconds (None with fewer than 2 tokens)."""
        if self.decode_time is None or self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens after the first, per second of decode time."""
        t = self.tpot
        return None if not t else 1.0 / t

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One choice of a request. ``text``/``token_ids`` are cumulative; ``delta_*`` hold the last step's part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched; None for EOS
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: chosen token and top-N alternatives
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # of the first choice
    # with SamplingParams.prompt_logprobs: per prompt token, that token and the top-N (None for the first token);
    # set once the whole prompt was computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
