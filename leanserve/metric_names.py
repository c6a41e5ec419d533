"""The Prometheus metric names shared by the server's ``/metrics`` and the benchmark client that reads it.

Each constant is a metric's name as the server registers it (vLLM's ``vllm:*`` names, plus leanserve's own
``leanserve:*`` GPU gauges); :data:`HELP` holds its help text. prometheus_client exposes a gauge's sample under
the registered name, a counter's as ``<name>_total`` and a histogram's as ``<name>_sum``, ``<name>_count`` and
``<name>_bucket``: :func:`counter_sample`, :func:`histogram_sum`, :func:`histogram_count` and
:func:`histogram_bucket` give those sample names. The ``*_ALIASES`` tuples name peer servers' metrics for the same
quantities, which the benchmark client also accepts; each alias is of the same kind as the metric it stands for,
so the same sample helper applies to it.

This module imports nothing from leanserve, nor prometheus_client: the server and the bench both import it.
"""

from __future__ import annotations

# --- labels -----------------------------------------------------------------------------------------------------
MODEL_NAME_LABEL = "model_name"  # on every vllm:* metric
FINISHED_REASON_LABEL = "finished_reason"  # on REQUEST_SUCCESS: "stop", "length" or "abort"
DEVICE_LABEL = "device"  # on the leanserve:gpu_memory_* gauges: CUDA device index
CACHE_KIND_LABEL = "kind"  # on ANSWER_CACHE_HITS: "exact" or "semantic"
POSITION_LABEL = "position"  # on SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS: a draft's place in its run, from 0

# --- gauges, read from the engine's stats at scrape time --------------------------------------------------------
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"

# --- counters (exposed as <name>_total) -------------------------------------------------------------------------
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
NUM_PREEMPTIONS = "vllm:num_preemptions"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # label "position"

# --- histograms (exposed as <name>_sum, <name>_count, <name>_bucket) --------------------------------------------
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"

# --- leanserve's own gauges (exported only when torch sees CUDA) ------------------------------------------------
GPU_MEMORY_ALLOCATED_BYTES = "leanserve:gpu_memory_allocated_bytes"
GPU_MEMORY_RESERVED_BYTES = "leanserve:gpu_memory_reserved_bytes"
# leanserve's answer cache: registered only with --answer-cache (so not in COUNTERS / HELP); read by `leanserve advise`
ANSWER_CACHE_QUERIES = "leanserve:answer_cache_queries"  # counter: deterministic requests looked up (--answer-cache)
ANSWER_CACHE_HITS = "leanserve:answer_cache_hits"  # counter (label kind): requests answered from the cache
ANSWER_CACHE_BYTES = "leanserve:answer_cache_bytes"  # gauge: bytes the answer cache holds (its bound's unit)
ANSWER_CACHE_ENTRIES = "leanserve:answer_cache_entries"  # gauge: answers the answer cache holds
# model routing (leanserve/routing): registered only with --model-router / --model-routers-file
ROUTER_LABEL = "router"  # the virtual model's name ("auto" or a named router)
ROUTED_MODEL_LABEL = "model"  # the real model that answered
ROUTER_REQUESTS = "leanserve:router_requests"  # counter (labels router, model_name): requests routed, by final model
ROUTER_ESCALATIONS = "leanserve:router_escalations"  # counter (label router): cascade answers escalated
ROUTER_HELP: dict[str, str] = {
    ROUTER_REQUESTS: "Requests to a virtual router model, by the real model that answered.",
    ROUTER_ESCALATIONS: "Cascade router: cheap answers judged too unsure and answered again by the strong model.",
}

GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC)
COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, NUM_PREEMPTIONS, PREFIX_CACHE_QUERIES,
            PREFIX_CACHE_HITS, SPEC_DECODE_NUM_DRAFTS, SPEC_DECODE_NUM_DRAFT_TOKENS, SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS)
HISTOGRAMS = (TIME_TO_FIRST_TOKEN_SECONDS, INTER_TOKEN_LATENCY_SECONDS, REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
              E2E_REQUEST_LATENCY_SECONDS, REQUEST_QUEUE_TIME_SECONDS, REQUEST_PREFILL_TIME_SECONDS,
              REQUEST_DECODE_TIME_SECONDS, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS)
GPU_GAUGES = (GPU_MEMORY_ALLOCATED_BYTES, GPU_MEMORY_RESERVED_BYTES)

HELP: dict[str, str] = {
    NUM_REQUESTS_RUNNING: "Number of sequences in the running batch.",
    NUM_REQUESTS_WAITING: "Number of sequences waiting to be scheduled.",
    KV_CACHE_USAGE_PERC: "KV cache usage: fraction of blocks in use, 0..1.",
    PROMPT_TOKENS: "Number of prefilled prompt tokens.",
    GENERATION_TOKENS: "Number of generated tokens.",
    REQUEST_SUCCESS: "Finished requests, by finish reason.",
    NUM_PREEMPTIONS: "Cumulative number of preemptions.",
    PREFIX_CACHE_QUERIES: "Prompt tokens looked up in the prefix cache.",
    PREFIX_CACHE_HITS: "Prompt tokens found in the prefix cache.",
    SPEC_DECODE_NUM_DRAFTS: "Speculative verifications: one per request and step that verified drafts.",
    SPEC_DECODE_NUM_DRAFT_TOKENS: "Draft tokens verified.",
    SPEC_DECODE_NUM_ACCEPTED_TOKENS: "Draft tokens accepted.",
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS: "Draft tokens accepted, by position in their run (0 = first).",
    TIME_TO_FIRST_TOKEN_SECONDS: "Time to first token, from arrival (queueing included).",
    INTER_TOKEN_LATENCY_SECONDS: "Time between consecutive output tokens.",
    REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS: "Mean time per output token after the first, per request.",
    E2E_REQUEST_LATENCY_SECONDS: "End-to-end request latency.",
    REQUEST_QUEUE_TIME_SECONDS: "Time from arrival to first scheduling.",
    REQUEST_PREFILL_TIME_SECONDS: "Time from first scheduling to first token.",
    REQUEST_DECODE_TIME_SECONDS: "Time from first to last output token.",
    REQUEST_PROMPT_TOKENS: "Prompt tokens per request.",
    REQUEST_GENERATION_TOKENS: "Generated tokens per request (all choices).",
    GPU_MEMORY_ALLOCATED_BYTES: "GPU memory held by tensors.",
    GPU_MEMORY_RESERVED_BYTES: "GPU memory reserved by torch.",
}

# --- peer servers' names for the same quantities, accepted by the benchmark client only ------------------------
# Older vLLM releases (V0 engine) spell the KV-cache metrics with "gpu_"; llama.cpp's llama-server (--metrics)
# exports gauges of its own. leanserve never exports these.
KV_CACHE_USAGE_PERC_ALIASES = ("vllm:gpu_cache_usage_perc",  # vLLM V0: gauge, 0..1
                               "llamacpp:kv_cache_usage_ratio")  # llama.cpp: gauge, 0..1
NUM_REQUESTS_RUNNING_ALIASES = ("llamacpp:requests_processing",)  # llama.cpp: gauge
NUM_REQUESTS_WAITING_ALIASES = ("llamacpp:requests_deferred",)  # llama.cpp: gauge
PREFIX_CACHE_QUERIES_ALIASES = ("vllm:gpu_prefix_cache_queries",)  # vLLM V0: counter
PREFIX_CACHE_HITS_ALIASES = ("vllm:gpu_prefix_cache_hits",)  # vLLM V0: counter
PROMPT_TOKENS_ALIASES = ("llamacpp:prompt_tokens",)  # llama.cpp: counter
GENERATION_TOKENS_ALIASES = ("llamacpp:tokens_predicted",)  # llama.cpp: counter

# --- read by `leanserve advise` where a server exports them (leanserve itself does not, today) -----------------
LLAMACPP_PROMPT_SECONDS = "llamacpp:prompt_seconds"  # llama.cpp: counter, seconds spent on prompts (all slots)
LLAMACPP_PREDICTED_SECONDS = "llamacpp:tokens_predicted_seconds"  # llama.cpp: counter, seconds spent generating
LLAMACPP_BUSY_SLOTS_PER_DECODE = "llamacpp:n_busy_slots_per_decode"  # llama.cpp: gauge, mean batch of a decode
PROCESS_RESIDENT_MEMORY_BYTES = "process_resident_memory_bytes"  # prometheus_client's process collector: gauge


def counter_sample(name: str) -> str:
    """The sample name under which the counter ``name`` is exposed: ``<name>_total``."""
    return f"{name}_total"


def histogram_sum(name: str) -> str:
    """The sample name of the histogram ``name``'s sum of observations: ``<name>_sum``."""
    return f"{name}_sum"


def histogram_count(name: str) -> str:
    """The sample name of the histogram ``name``'s number of observations: ``<name>_count``."""
    return f"{name}_count"


def histogram_bucket(name: str) -> str:
    """The sample name of the histogram ``name``'s cumulative buckets (label ``le``): ``<name>_bucket``."""
    return f"{name}_bucket"
