"""The thresholds ``leanserve advise``'s rules compare against, and the measured ratios its expected effects cite,
each with its reason. Change a number here and every rule and report that uses it follows.

Measured figures are the project's own (README, default model SmolLM2-135M-Instruct Q4_1 on an idle 2-core
x86 VM, 2026-11-30); they are the basis named in a recommendation, not a promise for other machines:
``--experiment`` measures the change on the operator's own.
"""

from __future__ import annotations

# --- the seed's recommended path (section 11), the order recommendations are ranked in ------------------------
STEPS: dict[int, str] = {
    1: "measure (TTFT, TPOT, throughput, memory, queue time)",
    2: "prompt and context",
    3: "inference engine",
    4: "continuous batching and capacity",
    5: "quantization (INT8 or a good INT4 first)",
    6: "KV cache",
    7: "advanced: paged attention, speculation, routing, caching",
}

# --- service-level objectives ------------------------------------------------------------------------------------
TTFT_SLO_MS = 2000.0  # the project's serving SLO (README "Serving benchmark", benchmarks/compare_servers.py)
TPOT_SLO_MS = 200.0  # same source: 5 tokens/s, about reading speed

# --- step 2: context ---------------------------------------------------------------------------------------------
# A mean prompt of 1,000 tokens costs ~1.2-1.7 s of prefill at 600-800 tok/s (README, 2-core CPU): over half of
# the 2 s TTFT SLO before any queueing, so prompt length is the first thing to cut.
LONG_PROMPT_TOKENS = 1000.0
# customer-service, whose requests share a system prompt, measured ~40% of prompt tokens from the prefix cache;
# under 30% little of a long prompt is reused and the prefill is paid in full.
LOW_PREFIX_HIT_RATE = 0.3

# --- step 4: queueing --------------------------------------------------------------------------------------------
# The seed (section 9): if queue time soars as load rises, capacity or scheduling is short. Over half of TTFT
# spent waiting means requests wait more than they compute.
QUEUE_DOMINATES_SHARE = 0.5
# Below 100 ms of mean queueing users do not notice it (the usual perceptual limit of "instant"), whatever the share.
QUEUE_MIN_MS = 100.0
# KV usage under 80% at the peak: memory is not what keeps waiting requests out (leanserve admits a request only
# when its blocks fit; a fuller cache than this can be the cause, and the KV rule takes over above KV_FULL).
KV_NOT_FULL = 0.8

# --- step 6: KV cache --------------------------------------------------------------------------------------------
# At 90% block usage a new prompt's blocks often do not fit: requests wait for blocks or running ones are preempted
# (each preemption recomputes that request's whole prefill).
KV_FULL = 0.9

# --- step 7: speculation -----------------------------------------------------------------------------------------
# Long outputs: 300 tokens at 30 tok/s are 10 s of decode (the seed: 600 tokens at 30 tok/s = 20 s); copywriting
# (300-800 output tokens) is the scenario the seed names for speculation.
LONG_OUTPUT_TOKENS = 300.0
# Low concurrency: with at most 4 sequences in flight a decode step reads all weights for few tokens and leaves
# compute idle (README, benchmarks.quant: a batch-32 step costs ~7.9x a batch-1 step for 32x the tokens), the spare
# compute speculation needs (the seed, section 6).
LOW_CONCURRENCY = 4.0
# Decode takes at least 70% of request time: speeding decode is what shortens requests.
DECODE_SHARE_HIGH = 0.7
# Below 50% acceptance a 4-token draft yields under 2 tokens per target pass ((1 - a^5) / (1 - a) = 1.94 at 0.5)
# while the draft and the verification of rejected tokens still cost compute.
LOW_ACCEPTANCE = 0.5
SPEC_EXAMPLE_ACCEPTANCE = 0.6  # the acceptance rate the expected effect is worked out at
SPEC_EXAMPLE_TOKENS = 4  # num_speculative_tokens of the suggested n-gram configuration

# --- step 7: answer cache ----------------------------------------------------------------------------------------
# leanserve recomputes at least 8 tokens and the last partial block of every prompt (README, prefix caching), so
# identical 200-500-token prompts measure ~90-95% hits; 85% and above means whole prompts repeat.
REPEAT_HIT_RATE = 0.85
REPEAT_MIN_REQUESTS = 4  # fewer requests than this are not a pattern of repetition

# --- --experiment --------------------------------------------------------------------------------------------
# A change must move its target metric by at least 5% to count as helping: short replays (16 requests) differ by
# a few percent between identical runs on a shared 2-core machine, so smaller differences are not told from noise.
MIN_IMPROVEMENT = 0.05

# --- measured ratios cited as the basis of expected effects (README, see the module doc) --------------------------
PREFILL_TOK_S = {512: 800, 2048: 600, 3000: 520}  # single prompt, native 4-bit weights
DECODE_TOK_S = {  # benchmarks.quant: (batch 1, batch 32) decode tok/s, prefill tok/s (512 tokens), weights MB
    "none": (35.2, 269.3, 601, 538), "int8": (41.2, 308.0, 515, 220), "auto": (137.0, 556.8, 766, 97)}
PREFIX_HIT_CUSTOMER_SERVICE = 0.40  # share of prompt tokens the prefix cache served on customer-service
KV_BYTES_PER_TOKEN_DEFAULT_MODEL = {"float32": 46080, "float16": 23040, "int8": 12240}
FLOAT16_ATTENTION_SPEEDUP = "1.4-1.6x"  # decode attention at 64 sequences x 750 tokens, float16 vs fp32 cache
VS_LLAMA_SERVER = ("customer-service max sustained rate 2.0 vs 0.75 req/s (2.67x); knowledge-qa median TTFT "
                   "0.15-0.42x of llama-server's; code-assistant 0.28-0.35x; output tok/s 1.0-1.7x")
