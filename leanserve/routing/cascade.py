"""The cascade router (FrugalGPT, Chen, Zaharia & Zou 2023, arXiv:2305.05176): the cheap model answers first; its
answer is kept unless a scorer judges it unreliable, and then the strong model answers the request again.

The scorer here is the cheap answer's mean token logprob (natural log, of the tokens it chose): under
``min_mean_logprob`` the request escalates. Streaming: the cheap answer is generated whole and judged before
anything is sent, so a streamed response is the kept (or the strong) answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from leanserve.errors import RouterConfigError
from leanserve.routing.base import RouteDecision, RouteInput


def mean_logprob(token_logprobs: Sequence[float]) -> float:
    """The mean of the chosen tokens' logprobs; ``-inf`` for an empty answer."""
    return sum(token_logprobs) / len(token_logprobs) if token_logprobs else -math.inf


class CascadePolicy:
    """Cheap first (:meth:`first`, also :meth:`decide`), then :meth:`judge` its answer.

    Raises:
        RouterConfigError: ``min_mean_logprob`` not a finite number <= 0.
    """

    kind = "cascade"

    def __init__(self, cheap: str, strong: str, min_mean_logprob: float = -1.0) -> None:
        if isinstance(min_mean_logprob, bool) or not isinstance(min_mean_logprob, int | float) \
                or not math.isfinite(min_mean_logprob) or min_mean_logprob > 0:
            raise RouterConfigError("min_mean_logprob", "min_mean_logprob must be a finite number <= 0 (a mean "
                                    f"log-probability), got {min_mean_logprob!r}")
        self.cheap, self.strong, self.min_mean_logprob = cheap, strong, float(min_mean_logprob)

    def first(self, request: RouteInput | None = None) -> RouteDecision:
        """The cheap model's decision: it always answers first."""
        return RouteDecision(self.cheap, self.kind, "cascade: cheap model first")

    decide = first

    def judge(self, token_logprobs: Sequence[float]) -> RouteDecision | None:
        """The strong model's decision when the cheap answer must be escalated, else None (keep it).

        Escalates when the answer is empty or its mean token logprob is strictly under ``min_mean_logprob``.
        """
        if not token_logprobs:
            return RouteDecision(self.strong, self.kind, "cascade: empty cheap answer, escalated", -math.inf)
        m = mean_logprob(token_logprobs)
        if m < self.min_mean_logprob:
            return RouteDecision(self.strong, self.kind,
                                 f"cascade: mean logprob {m:.2f} < {self.min_mean_logprob:.2f}, escalated", m)
        return None

    def kept(self, token_logprobs: Sequence[float]) -> RouteDecision:
        """The cheap model's final decision when :meth:`judge` keeps its answer (for the extension field)."""
        m = mean_logprob(token_logprobs)
        return RouteDecision(self.cheap, self.kind, f"cascade: mean logprob {m:.2f} >= {self.min_mean_logprob:.2f}",
                             m)


def calibrate_min_mean_logprob(answers: Sequence[Sequence[float]], escalation_share: float) -> float:
    """The ``min_mean_logprob`` under which ``escalation_share`` of these cheap answers fall (each answer: its
    token logprobs), so that that share escalates: midway between the k-th and (k+1)-th lowest means, k =
    round(share x n) (empty answers always escalate and count among them); 0 for a share of 1 (every answer
    not certain of each token escalates).

    Raises:
        RouterConfigError: no answers, or a share outside [0, 1].
    """
    if not 0.0 <= escalation_share <= 1.0:
        raise RouterConfigError("escalation_share", f"escalation_share must be in [0, 1], got {escalation_share!r}")
    if not answers:
        raise RouterConfigError("answers", "calibration needs at least one answer")
    means = sorted(mean_logprob(a) for a in answers)
    k = round(escalation_share * len(means))
    finite = [m for m in means if math.isfinite(m)]
    if k >= len(means):
        return 0.0  # every answer with a mean under 0 escalates
    upper = means[k]
    lower = means[k - 1] if k > 0 else -math.inf
    if not math.isfinite(upper):  # more empty answers than the share: they escalate anyway
        return min(finite) if finite else -1.0
    return upper if not math.isfinite(lower) else min(0.0, (lower + upper) / 2)
