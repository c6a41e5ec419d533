"""``ConfigResult``: what ``leanserve eval`` measures for one configuration.

Its own module so that :mod:`leanserve.tools.eval` (which fills it) and :mod:`leanserve.tools.eval_report`
(which presents it) both import it and neither imports the other's caller: eval -> eval_report -> eval_result.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConfigResult:
    """Everything measured for one configuration (None where not measured)."""

    name: str
    perplexity: float
    accuracy: float | None  # mean pass rate on the test set, in [0, 1]
    per_metric: dict[str, float] = field(default_factory=dict)  # mean score per metric
    first_token_agreement: float | None = None  # share of prompts whose first greedy token equals the baseline's
    continuation_agreement: float | None = None  # share of identical 32-token greedy continuations
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    decode_tok_s_b1: float | None = None
    decode_tok_s_b32: float | None = None
    eval_seconds: float = 0.0
