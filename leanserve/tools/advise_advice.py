"""The advice of each ``leanserve advise`` rule: :class:`Recommendation` and one builder per rule, which fills in
the evidence (the snapshot's numbers that triggered it), the exact change, the expected effect with its basis, and
the risk. Which builder runs when is decided by the table in :mod:`leanserve.tools.advise_rules`.

Builders are called only when their rule's condition holds, so they may rely on the numbers it checked.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from leanserve.config import EngineConfig, ServerConfig
from leanserve.tools import advise_thresholds as th
from leanserve.tools.advise_setup import Setup, change_flags
from leanserve.tools.advise_snapshot import Dist, Snapshot


@dataclass
class Recommendation:
    """One piece of advice.

    Attributes:
        id: the rule's id. step: its place on the seed's path (1-7, :data:`~advise_thresholds.STEPS`).
        title: one line. evidence: the numbers that triggered it (names carry their units).
        change: the exact change: ``leanserve serve`` flags, a request field, or a command to run.
        expected_effect: what should happen, in numbers where they can be worked out. basis: where they come from.
        risk: what can go wrong (the seed's cautions). source: the seed section or measurement behind the rule.
        serve_changes: EngineConfig fields the change sets (``--experiment`` can try it), None when the change is
            not a server flag. target: ``(bench JSON key, "lower" | "higher")`` the experiment judges it by.
        alternatives: other changes for the same finding.
    """

    id: str
    step: int
    title: str
    evidence: dict[str, Any]
    change: str
    expected_effect: str
    basis: str
    risk: str
    source: str = ""
    serve_changes: dict[str, Any] | None = None
    target: tuple[str, str] | None = None
    alternatives: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the issue's keys ``id, step, evidence, change, expected_effect, risk`` and the rest)."""
        return asdict(self)


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(float(x), digits)


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100.0 * x, 1)


def _mean(d: Dist | None) -> float | None:
    return None if d is None else d.mean


def _p(d: Dist | None, which: str) -> float | None:
    return None if d is None else getattr(d, which)


def _serve(setup: Setup, changes: dict[str, Any]) -> str:
    return "leanserve serve ... " + shlex.join(change_flags(changes))


def _has_option(name: str) -> bool:
    return any(f.name == name for cls in (EngineConfig, ServerConfig) for f in fields(cls))


def _assumed(setup: Setup) -> str:
    return "" if setup.known else " (leanserve's defaults assumed: pass --serve-args to say how it was started)"


def _pow2_at_least(n: float) -> int:
    k = 1
    while k < n:
        k *= 2
    return k


# ------------------------------------------------------------------------------------------------------ step 1
def missing_metrics(s: Snapshot, setup: Setup) -> Recommendation:
    blind = [what for what, _ in s.unseen]
    extra = {"llama.cpp": "; llama-server exports counters only with --metrics, and no latency histograms",
             "none": "; the server answers no /metrics"}.get(s.server_kind, "")
    cmd = (f"leanserve bench --base-url {setup.base_url} --workload {setup.workload} --num-prompts 32 "
           f"--request-rate 1 --result-json run.json, then leanserve advise --base-url {setup.base_url} "
           "--bench-json run.json")
    return Recommendation(
        "missing-metrics", 1, "measure first: the latencies users feel are not visible",
        {"server": s.server_kind, "cannot_see": blind},
        cmd, "TTFT / TPOT / ITL / E2EL percentiles measured at the client; the rules then see them" + extra,
        "the seed's step 1: optimize on measured TTFT, TPOT, throughput, memory and queue time",
        "a benchmark adds load: run it off-peak or against a copy of the server")


def prefix_cache_off(s: Snapshot, setup: Setup) -> Recommendation:
    return Recommendation(
        "prefix-cache-off", 2, "turn the prefix cache back on",
        {"enable_prefix_caching": False, "prefix_cache_hit_rate_pct": _pct(s.prefix_cache_hit_rate),
         "mean_prompt_tokens": _r(_mean(s.prompt_tokens))},
        "drop --no-enable-prefix-caching from `leanserve serve` (on by default)",
        f"prompts that share a beginning (system prompt, examples, earlier turns) skip its prefill: the shared system "
        f"prompt of customer-service gave ~{th.PREFIX_HIT_CUSTOMER_SERVICE:.0%} of prompt tokens from the cache, "
        "and the prefill part of TTFT falls by about the share served",
        "README serving benchmark (customer-service, prefix-cache hit rate)",
        "none for outputs: a prefix-cache hit leaves a prompt's output bitwise unchanged "
        "(tests/engine/test_prefix_cache_exact.py); cached blocks live in free KV memory only",
        serve_changes={"enable_prefix_caching": True}, target=("mean_ttft_ms", "lower"))


def context_too_long(s: Snapshot, setup: Setup) -> Recommendation:
    prompt = _mean(s.prompt_tokens)
    hit = s.prefix_cache_hit_rate or 0.0
    prefill = _mean(s.prefill_ms)
    rate = s.prefill_tokens_per_s
    if prefill is None:  # no per-request prefill time: work it out from the README's prefill speed
        rate = rate or th.PREFILL_TOK_S[2048]
        prefill = 1000.0 * prompt * (1 - hit) / rate
    ttft = _p(s.ttft_ms, "p50")
    after = None if ttft is None else max(ttft - prefill / 2, _mean(s.queue_ms) or 0.0)
    return Recommendation(
        "context-too-long", 2, "cut the prompts: long context, little of it reused",
        {"mean_prompt_tokens": _r(prompt), "p99_prompt_tokens": _r(_p(s.prompt_tokens, "p99")),
         "prefix_cache_hit_rate_pct": _pct(s.prefix_cache_hit_rate), "mean_prefill_ms": _r(prefill),
         "prefill_share_pct": _pct(s.prefill_share), "p50_ttft_ms": _r(ttft)},
        (("server side: send retrieved passages as `documents` with `top_k_documents` / `max_context_tokens` "
          "(de-duplicated, BM25-ranked) and chats with `max_prompt_tokens` (or `leanserve serve "
          "--max-prompt-tokens N --top-k-documents K`); " if _has_option("max_prompt_tokens") else
          "client side: send fewer, de-duplicated retrieved passages (RAG top_k, rerank), trim or summarize old "
          "turns; ")
         + f"put fixed instructions first and byte-identical so the prefix cache serves them; aim under "
         f"{th.LONG_PROMPT_TOKENS:.0f} tokens; measure with `leanserve bench --base-url {setup.base_url} "
         "--compare documents` or `--dataset trimmed.jsonl`"),
        f"halving the prompt saves at least half the prefill: ~{prefill / 2:.0f} ms of the {prefill:.0f} ms mean "
        + (f"(p50 TTFT {ttft:.0f} -> ~{after:.0f} ms)" if ttft is not None else "")
        + ", and halves the KV cache each request holds",
        f"prefill time grows at least linearly with the tokens computed (attention quadratically); this server "
        f"prefilled {rate or 0:.0f} computed tokens/s per request; README: ~{th.PREFILL_TOK_S[512]} tok/s at 512 "
        f"tokens, ~{th.PREFILL_TOK_S[2048]} at 2,048, ~{th.PREFILL_TOK_S[3000]} at 3,000 on a 2-core CPU",
        "cutting context can cut the answer: check quality on your own cases (the seed: send the most relevant "
        "passages, not the most)")


# ------------------------------------------------------------------------------------------------------ step 3
def framework(s: Snapshot, setup: Setup) -> Recommendation:
    model = setup.engine.model or "MODEL.gguf"
    return Recommendation(
        "framework", 3, "serve with an engine that batches continuously and caches prefixes",
        {"server": s.server_kind, "peak_waiting": s.waiting_peak, "peak_running": s.running_peak,
         "mean_busy_slots": _r(s.mean_concurrency, 2), "prefill_share_pct": _pct(s.prefill_share),
         "output_tok_s": _r(s.output_throughput)},
        f"leanserve serve --model {model} --max-num-seqs N (N = llama-server's -np) on the same GGUF file",
        f"measured side by side on the same GGUF (README, 8 sequences / slots, 2 threads): {th.VS_LLAMA_SERVER}",
        "benchmarks/compare_servers.py on an idle 2-core VM (README, Serving benchmark)",
        "another engine: check its outputs on your cases (leanserve's greedy output matches transformers'); "
        "llama-server features you rely on (grammars, the slots API) may be missing",
        serve_changes={}, target=("mean_ttft_ms", "lower"))


# ------------------------------------------------------------------------------------------------------ step 4
def queue_bound(s: Snapshot, setup: Setup) -> Recommendation:
    cap = setup.engine.max_num_seqs
    q, share = _mean(s.queue_ms), s.queue_share_of_ttft
    evidence = {"mean_queue_ms": _r(q), "mean_ttft_ms": _r(_mean(s.ttft_ms)), "queue_share_of_ttft_pct": _pct(share),
                "peak_waiting": s.waiting_peak, "peak_running": s.running_peak,
                "peak_kv_usage_pct": _pct(s.kv_usage_peak), "max_num_seqs": cap}
    risk = ("a bigger batch raises every request's TPOT and the KV cache in use (peak "
            f"{_pct(s.kv_usage_peak)}%): watch preemptions and TPOT")
    if s.running_peak is not None and s.running_peak >= cap:
        new = max(2 * cap, _pow2_at_least((s.running_peak or 0) + (s.waiting_peak or 0)))
        b1, b32 = th.DECODE_TOK_S["auto"][:2]
        return Recommendation(
            "queue-bound", 4, "requests queue for a batch slot: let more sequences run at once",
            evidence, _serve(setup, {"max_num_seqs": new}) + _assumed(setup),
            f"waiting requests join the running batch at once: the {q:.0f} ms mean queue time ({share:.0%} of TTFT) "
            f"falls toward the time to the next step, while KV stays under {th.KV_NOT_FULL:.0%}; TPOT grows with "
            f"the batch",
            f"the batch was full (peak running {s.running_peak:g} = --max-num-seqs {cap}) with KV at "
            f"{_pct(s.kv_usage_peak)}%; README (benchmarks.quant): a batch-32 decode step costs "
            f"~{32 * b1 / b32:.1f}x a batch-1 step for 32x the tokens ({b1} vs {b32} tok/s)",
            risk, serve_changes={"max_num_seqs": new}, target=("mean_ttft_ms", "lower"),
            alternatives=["more replicas when the machine is saturated (see the capacity advice)"])
    return Recommendation(
        "queue-bound", 4, "requests queue while the engine computes: add capacity",
        evidence, "another `leanserve serve` replica (other cores or machines) behind a load balancer (issue 19), "
        "or less compute per request (steps 2 and 5)",
        f"queue time falls once each replica's offered load is below its capacity; this server finished "
        f"{_r(s.request_throughput, 2)} req/s ({_r(s.output_throughput)} output tok/s): N replicas serve ~N x that",
        f"the batch was not full (peak running {s.running_peak} < --max-num-seqs {cap}{_assumed(setup)}): steps "
        "are compute-bound, so more sequences per step would not start requests sooner",
        "replicas multiply memory (weights and KV pool each); one machine's cores do not multiply",
        alternatives=[f"--max-num-batched-tokens above {setup.engine.max_num_batched_tokens} on a GPU with spare "
                      "compute (more prompt tokens per step)"])


# ------------------------------------------------------------------------------------------------------ step 5
def quantize_weights(s: Snapshot, setup: Setup) -> Recommendation:
    target = "auto" if setup.is_gguf else "int8"
    now, new = th.DECODE_TOK_S[setup.engine.quantization], th.DECODE_TOK_S[target]
    model = setup.engine.model or "(default)"
    return Recommendation(
        "quantize-weights", 5, "quantize the weights (gate the quality first)",
        {"quantization": setup.engine.quantization, "p50_tpot_ms": _r(_p(s.tpot_ms, "p50")),
         "decode_share_pct": _pct(None if s.prefill_share is None else 1 - s.prefill_share),
         "output_tok_s": _r(s.output_throughput)},
        f"leanserve eval --model {model} --configs {setup.engine.quantization},{target} --max-drop 0.05 on your own "
        f"test set (--test-set FILE); if it passes: {_serve(setup, {'quantization': target})}",
        f"decode batch 1 {now[0]} -> {new[0]} tok/s ({new[0] / now[0]:.1f}x), batch 32 {now[1]} -> {new[1]} "
        f"({new[1] / now[1]:.2f}x), prefill {now[2]} -> {new[2]} tok/s, weights {now[3]} -> {new[3]} MB",
        "README, benchmarks.quant (default model, 2-core CPU)",
        "INT4 can hurt complex reasoning, math and code more than INT8, and small models are more sensitive (the seed, "
        "section 3): gate on your own cases with `leanserve eval --max-drop`",
        serve_changes={"quantization": target}, target=("median_tpot_ms", "lower"))


# ------------------------------------------------------------------------------------------------------ step 6
def kv_pressure(s: Snapshot, setup: Setup) -> Recommendation:
    e = setup.engine
    current = {"auto": e.dtype, "float16": "float16", "int8": "int8"}[e.kv_cache_dtype]
    sizes = th.KV_BYTES_PER_TOKEN_DEFAULT_MODEL
    alternatives = []
    if current == "int8":
        pool = e.kv_cache_memory or 2 << 30
        change: dict[str, Any] = {"kv_cache_memory": 2 * pool}
        ratio, how = 2.0, f"twice the pool ({pool >> 20} -> {2 * pool >> 20} MiB)"
    else:
        new = "float16" if current == "float32" else "int8"
        change = {"kv_cache_dtype": new}
        ratio = sizes[current if current in sizes else "float16"] / sizes[new]
        how = (f"{ratio:.2f}x the tokens in the same memory ({sizes.get(current, 23040):,} -> {sizes[new]:,} B/token "
               "on the default model)")
        alternatives.append("--kv-cache-memory BYTES larger (CPU default 2 GiB) if the machine has the RAM")
    longest = (_p(s.prompt_tokens, "p99") or 0) + (_p(s.output_tokens, "p99") or 0)
    if setup.max_model_len and longest and longest < setup.max_model_len / 2:
        alternatives.append(f"--max-model-len {_pow2_at_least(longest)} (p99 prompt + output is {longest:.0f} of "
                            f"{setup.max_model_len}): caps one request's share of the pool; paged KV reserves nothing "
                            "up front, so it frees no blocks by itself")
    alternatives += ["--quantization for smaller weights: on CUDA the KV pool is 80% of the memory the weights leave",
                     "--max-num-seqs lower: fewer sequences share the pool (fewer preemptions, more queueing)"]
    peak = s.kv_usage_peak or 0.0
    return Recommendation(
        "kv-pressure", 6, "the KV cache is full: requests are preempted or wait for blocks",
        {"peak_kv_usage_pct": _pct(s.kv_usage_peak), "preemptions": s.preemptions, "peak_waiting": s.waiting_peak,
         "kv_cache_dtype": e.kv_cache_dtype, "mean_prompt_tokens": _r(_mean(s.prompt_tokens))},
        _serve(setup, change) + _assumed(setup),
        f"{how}: the same load would peak near {100 * peak / ratio:.0f}% instead of {100 * peak:.0f}%, and "
        f"preemptions ({s.preemptions or 0:g}, each recomputing a prefill) stop while demand fits"
        + (f"; a float16 cache also runs decode attention {th.FLOAT16_ATTENTION_SPEEDUP} faster at large batches"
           if change.get("kv_cache_dtype") == "float16" else ""),
        "KV bytes per token = 2 x layers x KV heads x head dim x bytes per element (`leanserve plan` prints yours); "
        "README (benchmarks.attention) for the attention speed",
        "float16 K/V: greedy text matched the fp32 cache on the prompts tried; int8 K/V changed 30% of near-tie "
        "32-token continuations (`leanserve eval`, 70% agreement): check with `leanserve eval --configs "
        "none,kv-float16,kv-int8`",
        serve_changes=change, target=("output_throughput", "higher"), alternatives=alternatives)


# ------------------------------------------------------------------------------------------------------ step 7
def _tokens_per_pass(a: float, k: int) -> float:
    """Expected tokens per target pass with acceptance rate ``a`` and ``k`` draft tokens (Leviathan et al. 2023)."""
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0


def speculation(s: Snapshot, setup: Setup) -> Recommendation:
    a, k = th.SPEC_EXAMPLE_ACCEPTANCE, th.SPEC_EXAMPLE_TOKENS
    gain = _tokens_per_pass(a, k)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": k})
    decode = _mean(s.decode_ms)
    if _has_option("speculative_config"):
        serve_changes = {"speculative_config": config}
        change = _serve(setup, serve_changes)
    else:
        change, serve_changes = ("speculative decoding is not in this leanserve build yet (issue 14 adds "
                                 f"`--speculative-config '{config}'`); today: stream the answers (request field "
                                 "`\"stream\": true`) so users read while it decodes"), None
    return Recommendation(
        "speculation", 7, "long answers at low concurrency: speculative decoding",
        {"mean_output_tokens": _r(_mean(s.output_tokens)), "mean_concurrency": _r(s.mean_concurrency, 2),
         "decode_share_pct": _pct(None if s.prefill_share is None else 1 - s.prefill_share),
         "mean_decode_ms": _r(decode), "p50_tpot_ms": _r(_p(s.tpot_ms, "p50"))},
        change,
        f"at acceptance {a:.0%} with {k} draft tokens a target pass yields {gain:.2f} tokens instead of 1, so decode "
        + (f"({decode:.0f} ms mean) " if decode else "") + f"could take ~1/{gain:.1f} of its time plus the drafting",
        "expected tokens per pass (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023); the seed, section 6",
        "pays only with spare compute and predictable output (the seed, section 6): at high load or low acceptance "
        "it slows decoding (vLLM and llama.cpp users report 1.4-3x slower under load)",
        serve_changes=serve_changes, target=("median_tpot_ms", "lower"))


def spec_low_acceptance(s: Snapshot, setup: Setup) -> Recommendation:
    a = s.spec_acceptance_rate or 0.0
    return Recommendation(
        "spec-low-acceptance", 7, "speculation is rejected too often to pay",
        {"spec_acceptance_rate_pct": _pct(a), "mean_concurrency": _r(s.mean_concurrency, 2)},
        "fewer draft tokens (num_speculative_tokens in --speculative-config), a draft closer to the target, or "
        "speculation off (drop the flag)",
        f"at {a:.0%} acceptance a {th.SPEC_EXAMPLE_TOKENS}-token draft yields "
        f"{_tokens_per_pass(a, th.SPEC_EXAMPLE_TOKENS):.2f} tokens per pass, {_tokens_per_pass(a, 1):.2f} with 1",
        "(1 - a^(k+1)) / (1 - a) tokens per pass (Leviathan et al. 2023)",
        "none for outputs: speculation keeps the target model's distribution")


def answer_cache(s: Snapshot, setup: Setup) -> Recommendation:
    hit = s.prefix_cache_hit_rate or 0.0
    if _has_option("answer_cache"):
        change = "leanserve serve ... --answer-cache exact (deterministic requests: temperature 0 or a seed)"
    else:
        change = ("an exact answer cache in front of the server for deterministic requests (request fields "
                  "`temperature: 0` or a `seed`), keyed by the model, the whole prompt and every sampling field; "
                  "leanserve's own (`--answer-cache`, issue 15) is not in this build")
    return Recommendation(
        "answer-cache", 7, "the same requests come again: answer them from a cache",
        {"prefix_cache_hit_rate_pct": _pct(hit), "requests": s.requests,
         "mean_output_tokens": _r(_mean(s.output_tokens)), "mean_decode_ms": _r(_mean(s.decode_ms))},
        change,
        "a cached answer skips the model: if a share r of requests repeats exactly, the server computes only 1 - r "
        f"of them (capacity x 1 / (1 - r)); the prefix cache already serves {hit:.0%} of prompt tokens but every "
        "answer is still decoded",
        f"whole prompts repeat: hit rates >= {th.REPEAT_HIT_RATE:.0%} are only reached when prompts match to their "
        "last block (leanserve recomputes at least 8 tokens of each); the seed, section 10: cache frequent questions",
        "only for deterministic requests; a key that forgets a field (max_tokens, stop, seed) returns wrong answers; "
        "answers go stale when the data behind them changes (use a TTL)")


# ---------------------------------------------------------------------------------------------------- fallbacks
def slo_miss(s: Snapshot, setup: Setup) -> Recommendation:
    ttft, prefill = _mean(s.ttft_ms), _mean(s.prefill_ms)
    prefill_share = None if not ttft or prefill is None else min(1.0, prefill / ttft)
    alternatives = []
    if prefill_share is not None and prefill_share >= 0.5:
        alternatives.append(
            f"prefill is {prefill_share:.0%} of TTFT at {s.prefill_tokens_per_s or 0:.0f} computed tokens/s per "
            "request: if the machine's cores are shared with other work, --threads below the core count (README, CPU "
            "kernels: ~0.7 s per token with 2 threads under a load of 3-4 on 2 cores, 50 ms with 1 thread)")
    return Recommendation(
        "slo-miss", 1, "over the SLOs, and no rule explains why: find the sustained rate",
        {"p99_ttft_ms": _r(_p(s.ttft_ms, "p99")), "p99_tpot_ms": _r(_p(s.tpot_ms, "p99")),
         "ttft_slo_ms": th.TTFT_SLO_MS, "tpot_slo_ms": th.TPOT_SLO_MS,
         "queue_share_of_ttft_pct": _pct(s.queue_share_of_ttft), "prefill_share_of_ttft_pct": _pct(prefill_share),
         "prefill_tokens_per_s": _r(s.prefill_tokens_per_s, 0)},
        f"leanserve bench --base-url {setup.base_url} --workload {setup.workload} --sweep 0.5,1,2 --goodput "
        f"ttft:{th.TTFT_SLO_MS:.0f} tpot:{th.TPOT_SLO_MS:.0f}",
        "the highest request rate this server sustains within the SLOs (DistServe's goodput): above it, add replicas "
        "or cut the work per request",
        "README, Serving benchmark (--sweep, max sustained rate)", "a sweep loads the server: run it off-peak",
        alternatives=alternatives)


def no_change(s: Snapshot, setup: Setup) -> Recommendation:
    idle = not s.requests
    return Recommendation(
        "no-change", 1, "idle: nothing to change" if idle else "healthy: no change needed",
        {"requests": s.requests, "p99_ttft_ms": _r(_p(s.ttft_ms, "p99")), "p99_tpot_ms": _r(_p(s.tpot_ms, "p99")),
         "peak_kv_usage_pct": _pct(s.kv_usage_peak), "peak_waiting": s.waiting_peak, "preemptions": s.preemptions},
        "none" + (f"; to see it under load: leanserve bench --base-url {setup.base_url} --workload {setup.workload}"
                  if idle else ""),
        f"TTFT and TPOT stay within {th.TTFT_SLO_MS:.0f} / {th.TPOT_SLO_MS:.0f} ms, nothing waits, no preemptions",
        "no rule's condition holds", "none")
