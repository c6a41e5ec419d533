"""``leanserve advise``'s rules as data: one table (:data:`RULES`) of condition -> advice, each with its place on
the seed's path and its source, and :func:`recommend`, which runs it.

A rule's condition is a predicate over the :class:`~leanserve.tools.advise_snapshot.Snapshot` and the
:class:`~leanserve.tools.advise_setup.Setup`, written with the named thresholds of
:mod:`leanserve.tools.advise_thresholds`; ``when`` says the same in words for the report. A condition holds only
on numbers that were seen: an unknown quantity never triggers a rule (except the one that says it is unknown).
Fallback rules run only when no other rule fired. Recommendations are ranked by step (the seed's order: low risk
and high gain first), then by their order in the table. To add a rule: write its advice in
:mod:`leanserve.tools.advise_advice`, add a row here, and a test with a snapshot that expects it first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from leanserve.tools import advise_advice as advice
from leanserve.tools import advise_thresholds as th
from leanserve.tools.advise_advice import Recommendation
from leanserve.tools.advise_setup import Setup
from leanserve.tools.advise_snapshot import Dist, Snapshot

Condition = Callable[[Snapshot, Setup], bool]
Advice = Callable[[Snapshot, Setup], Recommendation]


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``when`` (in words) ``applies`` -> ``advise``; ``step`` on the seed's path, ``source``
    of the rule; ``fallback`` rules run only when no other rule fired."""

    id: str
    step: int
    when: str
    source: str
    applies: Condition
    advise: Advice
    fallback: bool = False


def _mean(d: Dist | None) -> float | None:
    return None if d is None else d.mean


def _ge(value: float | None, limit: float) -> bool:
    return value is not None and value >= limit


def _lt(value: float | None, limit: float) -> bool:
    return value is not None and value < limit


def _le(value: float | None, limit: float) -> bool:
    return value is not None and value <= limit


def _served(s: Snapshot) -> bool:
    return bool(s.requests)


def _missing(s: Snapshot, setup: Setup) -> bool:
    return s.ttft_ms is None


def _prefix_off(s: Snapshot, setup: Setup) -> bool:
    return (setup.known and not setup.engine.enable_prefix_caching and _served(s)
            and s.server_kind in ("leanserve", "unknown"))


def _long_context(s: Snapshot, setup: Setup) -> bool:
    hit = s.prefix_cache_hit_rate
    return _ge(_mean(s.prompt_tokens), th.LONG_PROMPT_TOKENS) and (hit is None or hit < th.LOW_PREFIX_HIT_RATE)


def _other_engine(s: Snapshot, setup: Setup) -> bool:
    return s.server_kind == "llama.cpp"


def _queue_bound(s: Snapshot, setup: Setup) -> bool:
    return (_ge(s.queue_share_of_ttft, th.QUEUE_DOMINATES_SHARE) and _ge(_mean(s.queue_ms), th.QUEUE_MIN_MS)
            and (s.kv_usage_peak is None or s.kv_usage_peak < th.KV_NOT_FULL))


def _unquantized(s: Snapshot, setup: Setup) -> bool:
    q = setup.engine.quantization
    return (setup.known and _served(s) and s.server_kind != "llama.cpp"
            and (q == "none" or (q == "int8" and setup.is_gguf)))


def _kv_full(s: Snapshot, setup: Setup) -> bool:
    return _ge(s.kv_usage_peak, th.KV_FULL) and ((s.preemptions or 0) > 0 or (s.waiting_peak or 0) > 0)


def _long_outputs_idle_compute(s: Snapshot, setup: Setup) -> bool:
    decode_heavy = s.prefill_share is None or s.prefill_share <= 1 - th.DECODE_SHARE_HIGH
    return (_ge(_mean(s.output_tokens), th.LONG_OUTPUT_TOKENS) and _le(s.mean_concurrency, th.LOW_CONCURRENCY)
            and decode_heavy and s.spec_acceptance_rate is None)


def _low_acceptance(s: Snapshot, setup: Setup) -> bool:
    return _lt(s.spec_acceptance_rate, th.LOW_ACCEPTANCE)


def _repeats(s: Snapshot, setup: Setup) -> bool:
    return (_ge(s.prefix_cache_hit_rate, th.REPEAT_HIT_RATE) and (s.requests or 0) >= th.REPEAT_MIN_REQUESTS
            and s.answer_cache_hit_rate is None)


def _p99(d: Dist | None) -> float | None:
    return None if d is None else d.p99


def _over_slo(s: Snapshot, setup: Setup) -> bool:
    p99 = _p99
    return _ge(p99(s.ttft_ms), th.TTFT_SLO_MS) or _ge(p99(s.tpot_ms), th.TPOT_SLO_MS)


RULES: tuple[Rule, ...] = (
    Rule("missing-metrics", 1, "no TTFT distribution: neither latency histograms in /metrics nor --bench-json",
         "seed section 11, step 1 (measure TTFT, TPOT, throughput, memory, queue time first)",
         _missing, advice.missing_metrics),
    Rule("prefix-cache-off", 2, "--serve-args says --no-enable-prefix-caching and requests were served",
         "seed section 7 (shared prompts); README: ~40% prefix hits on customer-service", _prefix_off,
         advice.prefix_cache_off),
    Rule("context-too-long", 2,
         f"mean prompt >= {th.LONG_PROMPT_TOKENS:.0f} tokens and prefix-cache hit rate < {th.LOW_PREFIX_HIT_RATE:.0%}"
         " (or unknown)", "seed sections 7 and 11 step 2; README prefill speed by prompt length", _long_context,
         advice.context_too_long),
    Rule("framework", 3, "the server is llama.cpp's llama-server",
         "seed section 11 step 3; README: leanserve vs llama-server side by side", _other_engine, advice.framework),
    Rule("queue-bound", 4,
         f"queue >= {th.QUEUE_DOMINATES_SHARE:.0%} of TTFT and >= {th.QUEUE_MIN_MS:.0f} ms mean, KV peak < "
         f"{th.KV_NOT_FULL:.0%} (or unknown)", "seed section 9 (queue time) and section 11 step 4",
         _queue_bound, advice.queue_bound),
    Rule("quantize-weights", 5, "--serve-args says --quantization none (or int8 on a GGUF file) and requests were "
         "served", "seed sections 3 and 11 step 5; README benchmarks.quant", _unquantized, advice.quantize_weights),
    Rule("kv-pressure", 6, f"KV peak >= {th.KV_FULL:.0%} with preemptions or waiting requests",
         "seed sections 2 and 11 step 6; KV bytes per token (leanserve plan)", _kv_full, advice.kv_pressure),
    Rule("speculation", 7,
         f"mean output >= {th.LONG_OUTPUT_TOKENS:.0f} tokens, mean concurrency <= {th.LOW_CONCURRENCY:g}, decode >= "
         f"{th.DECODE_SHARE_HIGH:.0%} of request time, no speculation yet",
         "seed sections 6, 10 (copywriting) and 11 step 7", _long_outputs_idle_compute, advice.speculation),
    Rule("spec-low-acceptance", 7, f"speculative acceptance rate < {th.LOW_ACCEPTANCE:.0%}",
         "seed section 6 (a poor draft is rejected often and the speed-up falls)", _low_acceptance,
         advice.spec_low_acceptance),
    Rule("answer-cache", 7,
         f"prefix-cache hit rate >= {th.REPEAT_HIT_RATE:.0%} over >= {th.REPEAT_MIN_REQUESTS} requests, no answer "
         "cache yet", "seed sections 10 (cache frequent questions) and 11 step 7", _repeats, advice.answer_cache),
    Rule("slo-miss", 1, f"no other rule fired and p99 TTFT >= {th.TTFT_SLO_MS:.0f} ms or p99 TPOT >= "
         f"{th.TPOT_SLO_MS:.0f} ms", "seed section 9; README max sustained rate", _over_slo, advice.slo_miss,
         fallback=True),
    Rule("no-change", 1, "no other rule fired", "seed section 11: change only what the numbers show",
         lambda s, setup: True, advice.no_change, fallback=True),
)


def recommend(snapshot: Snapshot, setup: Setup, rules: tuple[Rule, ...] = RULES) -> list[Recommendation]:
    """The recommendations of every rule whose condition holds, ranked by step, then table order; when none of
    the regular rules holds, the first fallback rule that does. Each carries its rule's ``source``."""
    fired = [(i, r) for i, r in enumerate(rules) if not r.fallback and r.applies(snapshot, setup)]
    if not fired:
        fired = next(([(i, r)] for i, r in enumerate(rules) if r.fallback and r.applies(snapshot, setup)), [])
    out = []
    for _, rule in sorted(fired, key=lambda pair: (pair[1].step, pair[0])):
        rec = rule.advise(snapshot, setup)
        rec.source = rule.source
        out.append(rec)
    return out
