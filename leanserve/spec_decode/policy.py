"""How many drafts each request verifies in a step: only as many as its acceptance rate makes worth their cost.

With a draft model the drafts also cost its own decode steps, one per draft position, batched over the requests
that draft: :meth:`SpeculationPolicy.plan_draft_model` picks one k for them by the same expected-tokens-per-second
measure, with both models' step costs measured at start.

Verifying a request's k drafts adds k rows to the step. The j-th draft is kept only if the j - 1 before it were,
so with a per-token acceptance rate a it yields a^j tokens in expectation (the expected run is
(1 - a^(k+1)) / (1 - a) tokens, Leviathan et al. 2023, eq. 1). A step of R decode rows costs t(R) seconds, measured
on this machine (:class:`StepCostModel`). Drafts are added one at a time, the most likely first, while they raise
the step's expected tokens per second: draft gain g is worth it when (T + g) / t(R + 1) > T / t(R). On a machine
where rows cost nothing extra (a weight-bound small batch) every likely draft is verified; where rows cost
proportionally (a compute-bound large batch) none is, so speculation does not lower throughput under load.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Acceptance prior: a request that has verified nothing yet is assumed to accept half its drafts, with the weight
# of this many observed drafts (so a few verifications dominate it).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
DECAY = 0.9  # weight of older verifications per new one: the rate follows changes in the text within ~10 steps


class StepCostModel:
    """Seconds of a decode step by its number of rows, from measurements (interpolated; extrapolated linearly).

    Args:
        measured: rows -> seconds, at least one point. Made non-decreasing in rows (a running maximum): more rows
            never cost less, so a noisy point cannot make extra rows look free.
    """

    def __init__(self, measured: dict[int, float]) -> None:
        if not measured:
            raise ValueError("StepCostModel needs at least one measurement")
        self.rows = sorted(measured)
        self.seconds = []
        for r in self.rows:
            self.seconds.append(max(measured[r], self.seconds[-1] if self.seconds else 0.0))

    def __call__(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if len(xs) == 1:
            return ys[0] * max(rows, 1) / xs[0]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ys[i]
        i = min(max(i, 1), len(xs) - 1)  # the segment [i - 1, i], extended at both ends
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 1e-9)


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


class SpeculationPolicy:
    """Per-request acceptance rates and the per-step choice of how many drafts to verify.

    Args:
        cost: the measured cost of a decode step by rows; None: always verify every draft (``adaptive`` off).
    """

    def __init__(self, cost: StepCostModel | None, draft_cost: StepCostModel | None = None) -> None:
        self.cost = cost
        self.draft_cost = draft_cost  # a draft model's decode step by rows (draft_model method)
        self._acceptance: dict[str, _Acceptance] = {}

    def acceptance_rate(self, request_id: str) -> float:
        """The request's estimated per-token acceptance rate (the prior until it verified drafts)."""
        acc = self._acceptance.get(request_id)
        return acc.rate if acc else PRIOR_ACCEPTANCE

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verification: ``num_accepted`` of ``num_drafts`` kept (a rejection ended the run unless all
        were kept)."""
        if num_drafts <= 0:
            return
        acc = self._acceptance.setdefault(request_id, _Acceptance())
        acc.accepted = acc.accepted * DECAY + num_accepted
        acc.trials = acc.trials * DECAY + num_accepted + (num_accepted < num_drafts)

    def reset(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)

    def plan(self, num_decodes: int, proposals: dict[str, int]) -> dict[str, int]:
        """Drafts to verify per request.

        Args:
            num_decodes: decode requests in the step (with and without proposals).
            proposals: request id -> drafts proposed for it.

        Returns:
            request id -> drafts to verify (0..proposed).
        """
        if self.cost is None:
            return dict(proposals)
        rates = {rid: self.acceptance_rate(rid) for rid in proposals}
        chosen = dict.fromkeys(proposals, 0)
        rows, tokens = num_decodes, float(num_decodes)
        while True:
            best, gain = None, 0.0
            for rid, n in proposals.items():
                k = chosen[rid]
                if k < n and rates[rid] ** (k + 1) > gain:
                    best, gain = rid, rates[rid] ** (k + 1)
            if best is None:
                break
            if (tokens + gain) / self.cost(rows + 1) <= tokens / self.cost(rows):
                break
            chosen[best] += 1
            rows += 1
            tokens += gain
        return chosen

    def plan_draft_model(self, num_decodes: int, candidates: list[str], max_k: int) -> int:
        """Drafts per candidate for a draft model, the same k for all (its draft steps are batched): the k in
        0..max_k with the most expected tokens per second, counting the target's verification rows and k draft
        steps over the candidates; ``max_k`` while any candidate has no acceptance measured yet."""
        if self.cost is None or self.draft_cost is None or not candidates:
            return max_k if candidates else 0
        if any(rid not in self._acceptance for rid in candidates):
            return max_k  # a request not yet measured: verify a full run once, so its rate is learnt (else the prior
            # alone could keep k at 0 forever)
        rates = [self.acceptance_rate(rid) for rid in candidates]
        best_k, best = 0, num_decodes / self.cost(num_decodes)
        for k in range(1, max_k + 1):
            tokens = num_decodes + sum(sum(a ** j for j in range(1, k + 1)) for a in rates)
            seconds = self.cost(num_decodes + k * len(candidates)) + k * self.draft_cost(len(candidates))
            if tokens / seconds > best:
                best_k, best = k, tokens / seconds
        return best_k
