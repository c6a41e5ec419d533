"""Configuration dataclasses: the model's architecture, the engine's knobs and the HTTP server's.

:class:`EngineConfig` and :class:`ServerConfig` are the one source of each option's default, unit and help text:
``leanserve``'s command-line flags (:func:`add_config_args`, :func:`config_from_args`) and ``LLM(**kwargs)`` are
derived from their fields, as vLLM derives its CLI from ``EngineArgs``. Both validate themselves on construction
(``__post_init__``) and raise :class:`~leanserve.errors.InvalidParameterError` naming the field.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from leanserve.errors import InvalidParameterError, UnsupportedQuantizationError

DTYPES = ("float32", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
SCHEDULING_POLICIES = ("fcfs", "priority")
ANSWER_CACHE_MODES = ("off", "exact", "semantic")
LOG_LEVELS = ("debug", "info", "warning", "error")
REPLICA_ROUTERS = ("cache_aware", "round_robin", "power_of_two")  # --replica-router (entrypoints/ray_serve)
ROUTER_POLICIES = ("rules", "learned", "cascade")  # --model-router POLICY[:ARG] (leanserve/routing)
# --quantization: "auto" keeps GGUF Q4_0/Q4_1/Q8_0 matrices (embedding and output included) in their file layout
# for leanserve's block kernels (or, without native kernels, the projections in torch's packed int4/int8 layouts)
# and everything else in float; "none" dequantizes everything to the model dtype; "int8" and "int4" quantize
# every projection from float weights at load.
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
# --prefill-gemm: the kernel of prefill rows with lane-layout GGUF weights (leanserve/quantization/prefill_gemm.py)
PREFILL_GEMMS = ("auto", "lane", "bf16", "bf16x3", "int8")
KV_CACHE_DTYPES = ("auto", "float16", "int8")  # "auto" = the model dtype
INT4_GROUP_SIZES = (32, 64, 128)  # input columns per int4 scale


def check_quantization(method: str, group_size: int = 32) -> None:
    """Validate a ``--quantization`` method and its int4 group size (elements along the input dimension).

    Raises:
        UnsupportedQuantizationError: an unknown method (e.g. "fp8", "gptq") or a group size not in 32/64/128.
    """
    if method not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            "quantization", f"unsupported quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    if group_size not in INT4_GROUP_SIZES:
        raise UnsupportedQuantizationError(
            "quantization_group_size",
            f"unsupported int4 group size {group_size}; supported: {', '.join(map(str, INT4_GROUP_SIZES))}")


def check_kv_cache_dtype(dtype: str) -> None:
    """Validate a ``--kv-cache-dtype``.

    Raises:
        UnsupportedQuantizationError: anything but "auto", "float16" or "int8" (fp8 is not offered: no fp8 math
            on the CPUs served).
    """
    if dtype not in KV_CACHE_DTYPES:
        raise UnsupportedQuantizationError(
            "kv_cache_dtype", f"unsupported kv_cache_dtype {dtype!r}; supported: {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from GGUF metadata or an HF ``config.json``.

    All sizes are element counts; ``head_dim`` is per attention head.
    """

    architecture: str  # "llama", "mistral", "qwen2" or "gemma3"
    num_layers: int  # transformer blocks
    hidden_size: int  # model width (embedding size)
    intermediate_size: int  # MLP width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int  # size of one head; usually hidden_size // num_heads
    vocab_size: int  # rows of the embedding / output matrix
    max_position_embeddings: int  # the model's context length, in tokens
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style RoPE scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} or {"rope_type": "linear",
    # "factor": 2.0}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False  # output projection shares the token embedding
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    # Gemma 3 (architecture "gemma3"; None / defaults for the Llama family): each layer's attention kind, HF's
    # names "sliding_attention" (local) or "full_attention" (global); None: every layer global.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # keys a local layer's query sees, itself included (HF's sliding_window)
    rope_local_theta: float | None = None  # RoPE base of the local layers (HF's rope_local_base_freq)
    query_pre_attn_scalar: float | None = None  # attention scale is query_pre_attn_scalar**-0.5 (None: head_dim)

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) is a sliding-window (local) attention layer."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes in fp32: 2 (K and V) x layers x KV heads x head dim x 4."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def option(default: Any, help: str, *, type: Any = None, flag: str | None = None, aliases: tuple[str, ...] = (),
           choices: tuple[Any, ...] | None = None, metavar: str | None = None, dest: str | None = None,
           cli: bool = True, repeat: bool = False) -> Any:
    """A dataclass field with its command-line description.

    Args:
        default: the field's default (also the flag's).
        help: one line for ``--help``: what it does and its unit.
        type: the flag's argparse type (None: str, or a boolean switch for bool defaults).
        flag: the flag's name when it is not ``--field-name`` (for a bool defaulting to True: the switch that
            turns it off, e.g. ``--no-enable-prefix-caching``).
        aliases: more names for the flag (e.g. ``-q``).
        choices: the allowed values, checked by argparse and named in ``--help``.
        metavar: the value's name in ``--help`` (default: N for integers).
        dest: the parsed value's attribute when it is not the field's name (a command's own flag may use that name).
        cli: False for options of the Python API only.
        repeat: the flag may be given several times; the value is then the list of them (None when absent).
    """
    if metavar is None and type is int:
        metavar = "N"
    meta = {"help": help, "type": type, "flag": flag, "aliases": aliases, "choices": choices, "metavar": metavar,
            "dest": dest, "cli": cli, "repeat": repeat}
    return field(default=default, metadata=meta)


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidParameterError(name, f"{name} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidParameterError(name, f"{name} must be one of {', '.join(choices)}; got {value!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each decode step of a request may verify up to
    ``num_speculative_tokens`` proposed tokens at once, keeping exactly the target model's output distribution.

    Raises:
        InvalidParameterError: on construction, naming the field (``speculative_config.<field>``).
    """

    # "ngram": prompt lookup (Saxena 2023) over the request's own prompt and output; "draft_model": greedy drafts
    # of a smaller (or more quantized) model with the target's vocabulary
    method: str = "ngram"
    num_speculative_tokens: int = 4  # most draft tokens verified per request and step
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram looked up (tokens)
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram looked up (tokens)
    model: str | None = None  # draft_model: GGUF file or HF folder (None: the target's own file)
    quantization: str = "auto"  # draft_model: its weights (see EngineConfig.quantization)
    # Per step, propose only as many tokens as each request's running acceptance rate makes worth their measured
    # verification cost (False: always propose up to num_speculative_tokens)
    adaptive: bool = True
    # draft_model: the draft reads and writes the target's KV cache instead of its own (None: when the draft is the
    # target's own file, whose K/V projections it shares; True elsewhere needs the same layer and head shapes)
    share_kv_cache: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("speculative_config.method", self.method, SPECULATIVE_METHODS)
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise InvalidParameterError("speculative_config.prompt_lookup_max",
                                        f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                                        f"({self.prompt_lookup_min})")
        if not isinstance(self.adaptive, bool):
            raise InvalidParameterError("speculative_config.adaptive", "adaptive must be a boolean")
        if self.share_kv_cache is not None and not isinstance(self.share_kv_cache, bool):
            raise InvalidParameterError("speculative_config.share_kv_cache", "share_kv_cache must be a boolean")
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise InvalidParameterError("speculative_config.model",
                                        "model must be a path (a GGUF file or an HF folder)")
        _check_choice("speculative_config.quantization", self.quantization, QUANTIZATION_METHODS)
        # a field of the other method is a mistake in the config (it would do nothing): name it
        other = {"ngram": {"model": None, "quantization": "auto", "share_kv_cache": None},
                 "draft_model": {"prompt_lookup_min": 1, "prompt_lookup_max": 4}}[self.method]
        for name, default in other.items():
            if getattr(self, name) != default:
                raise InvalidParameterError(f"speculative_config.{name}", f"{name} does not apply to method "
                                            f"{self.method!r} (it is a field of the other method)")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict of its fields, or their JSON text (``--speculative-config``); None stays None.

        Raises:
            InvalidParameterError: bad JSON, an unknown field, or a bad value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError("speculative_config", f"speculative_config is not valid JSON: {exc}") \
                    from None
        if not isinstance(value, dict):
            raise InvalidParameterError("speculative_config", "speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidParameterError(f"speculative_config.{unknown[0]}",
                                        f"unknown speculative_config field {unknown[0]!r}; known: "
                                        f"{', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Knobs of the engine (names follow vLLM's engine arguments).

    Raises:
        InvalidParameterError (UnsupportedQuantizationError among them): on construction, for a value of the
            wrong type or out of range; ``.param`` names the field. Checks that need the model (``max_model_len``
            beyond its context, a KV pool too small for one block) are made by the engine before the weights load.
    """

    model: str | None = option(None, "GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)",
                               metavar="PATH")
    dtype: str = option("float32", "weights and activations", choices=DTYPES)
    block_size: int = option(16, "tokens per KV cache block", type=int)
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache pool (default: 2 GiB on CPU, 80%% of the free memory on CUDA)", type=int,
        metavar="BYTES")
    max_num_seqs: int = option(64, "most sequences in one step", type=int)
    max_num_batched_tokens: int | None = option(2048, "token budget of one step (tokens)", type=int)
    max_model_len: int | None = option(None, "context limit, prompt + output, in tokens (default: the model's)",
                                       type=int)
    enable_prefix_caching: bool = option(True, "turn off the prefix cache", flag="--no-enable-prefix-caching")
    long_prefill_token_threshold: int | None = option(
        None, "a prompt longer than this advances at most this many tokens per step, and one such prompt "
        "prefills at a time (default: 256 on CPU, 2048 on CUDA; 0 = off)", type=int)
    scheduling_policy: str = option("fcfs", "fcfs, or priority (lower request priority first)",
                                    choices=SCHEDULING_POLICIES)
    seed: int = option(0, "seed of the engine's generator, for requests that carry none", type=int,
                       flag="--engine-seed", dest="engine_seed")
    num_threads: int | None = option(
        None, "CPU threads for matmuls and attention (torch's and BLAS pools; default: all cores; fewer on a "
        "machine shared with busy processes)", type=int, flag="--threads")
    use_native_kernels: bool = option(True, "use the torch paths instead of the compiled CPU kernels",
                                      flag="--no-native-kernels")
    batch_invariant: bool = option(False, "bitwise batch-invariant logits: seeded output independent of the "
                                   "batch (fp32 on CPU only; slower decode)")
    quantization: str = option("auto", "weights: auto (GGUF Q4_0/Q4_1/Q8_0 kept in their native bits), none "
                               "(float), int8 or int4 (quantized at load)", aliases=("-q",),
                               choices=QUANTIZATION_METHODS)
    quantization_group_size: int = option(32, "int4 input columns per scale", type=int, choices=INT4_GROUP_SIZES)
    prefill_gemm: str = option("auto", "prefill rows of GGUF Q4_0/Q4_1/Q8_0 weights (and of --quantization int4 "
                               "at group size 32): lane (int16 kernel), bf16 (bf16 copy + AVX512_BF16 GEMM, fp32 "
                               "output), bf16x3 (split bf16, near fp32), int8 (int8 activations on 4-bit weights, as "
                               "llama.cpp), auto (bf16 where the CPU has AVX512_BF16, else int8 on AVX2 builds, else "
                               "lane)", choices=PREFILL_GEMMS)
    kv_cache_dtype: str = option("auto", "KV cache: auto (the model dtype), float16, or int8 (a scale per token "
                                 "and KV head)", choices=KV_CACHE_DTYPES)
    kv_cache_prefault: bool = option(False, "make the whole KV pool resident at start (written once, its zeros "
                                     "kept), as llama.cpp's KV clear does: the first requests then pay no page "
                                     "faults, for a longer start where memory is slow to fault in (VMs)")
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (fields of '
        "SpeculativeConfig; default: off)", metavar="JSON")

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # a pathlib.Path
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_int("block_size", self.block_size, 1)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, optional=True)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_int("seed", self.seed, -(2**63))
        _check_int("num_threads", self.num_threads, 1, optional=True)
        for name in ("enable_prefix_caching", "use_native_kernels", "batch_invariant", "kv_cache_prefault"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"{name} must be a boolean, got {getattr(self, name)!r}")
        check_quantization(self.quantization, self.quantization_group_size)
        _check_choice("prefill_gemm", self.prefill_gemm, PREFILL_GEMMS)
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


@dataclass
class ServerConfig:
    """Options of the HTTP server around one engine (``leanserve serve``).

    Raises:
        InvalidParameterError: on construction, for a port outside 0-65535, ``max_waiting`` < 1, an unknown
            log level, a negative limit or timeout, an empty API key, ``answer_cache_similarity`` given while
            ``answer_cache`` is not "semantic", ``answer_cache_bytes`` / ``answer_cache_ttl`` given while
            ``answer_cache`` is "off", a ``model_router`` of an unknown policy or a ``strong_share``
            outside [0, 1] (the router definitions themselves are checked by ``leanserve.routing.build_router``).
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on (0: any free port)", type=int)
    api_key: str | list[str] | None = option(
        None, "require 'Authorization: Bearer KEY' on the API endpoints; repeat for several keys (tenants "
        "key-1, key-2, ...; one key: tenant default)", metavar="KEY", repeat=True)
    api_keys_file: str | None = option(
        None, "JSON file of tenants, each with its own key and optional limits: [{\"name\": ..., \"key\": ..., "
        "\"max_concurrent\": N, \"requests_per_minute\": N, \"tokens_per_minute\": N}, ...]", metavar="PATH")
    tenant_max_concurrent: int | None = option(
        None, "default per-tenant limit: requests in flight at once (429 + Retry-After beyond it)", type=int)
    tenant_requests_per_minute: int | None = option(
        None, "default per-tenant limit: generation requests per minute (429 + Retry-After beyond it)", type=int)
    tenant_tokens_per_minute: int | None = option(
        None, "default per-tenant limit: prompt + generated tokens per minute (429 + Retry-After beyond it)",
        type=int)
    max_request_bytes: int = option(8 << 20, "largest request body in bytes; larger ones get 413", type=int,
                                    metavar="BYTES")
    shutdown_timeout: float = option(
        30.0, "on SIGTERM, seconds the in-flight requests may take to finish (new ones get 503) before the rest "
        "are aborted; a second signal ends at once", type=float, metavar="SECONDS")
    request_timeout: float | None = option(
        None, "abort a request running longer than this many seconds from its arrival (default: no limit)",
        type=float, metavar="SECONDS")
    engine_stall_timeout: float = option(
        10.0, "/health fails when the engine loop has not advanced for this many seconds while it has work",
        type=float, metavar="SECONDS")
    served_model_name: str | list[str] | None = option(
        None, "model name of the API (default: the model file's name); with --model repeated, repeat it in the "
        "same order", metavar="NAME", repeat=True)
    models_config: str | None = option(
        None, "serve several models: a JSON list of objects of engine options (EngineConfig field names, e.g. "
        "model, quantization, kv_cache_memory, max_num_seqs) plus served_model_name; the command line's engine "
        "flags are every model's defaults", metavar="PATH")
    serialize_model_steps: bool = option(
        True, "with several models, let their engine steps run at the same time (default: one step at a time, "
        "first come first served, each with every thread)", flag="--no-serialize-model-steps")
    max_waiting: int = option(1024, "most sequences waiting to be scheduled; beyond it requests get 503 + "
                              "Retry-After", type=int)
    log_level: str = option("info", "log level of the server", choices=LOG_LEVELS)
    # context optimization (leanserve.context): defaults of the request fields of the same names; None = off
    max_prompt_tokens: int | None = option(
        None, "chat history budget: drop the oldest turns so the prompt has at most this many tokens (system "
        "messages and the latest user turn stay; reported in usage.leanserve)", type=int)
    history_summary_tokens: int | None = option(
        None, "replace the turns the history budget drops with a summary of at most this many tokens, written by "
        "the served model once per dropped prefix and reused (0 = off)", type=int)
    max_context_tokens: int | None = option(None, "token budget of a request's documents (RAG passages)", type=int)
    top_k_documents: int | None = option(None, "most documents (RAG passages) kept per request", type=int)
    answer_cache: str = option("off", "answer cache of deterministic requests (temperature 0 or a seed), per API "
                               "key: off, exact, or semantic (exact, then a similar last user message in the "
                               "same context)", choices=ANSWER_CACHE_MODES)
    answer_cache_bytes: int | None = option(None, "with --answer-cache only: size bound of the answer cache "
                                            "(default: 64 MiB)", type=int, metavar="BYTES")
    answer_cache_ttl: float | None = option(None, "with --answer-cache only: seconds an answer stays in the answer "
                                            "cache (default: 600)", type=float, metavar="SECONDS")
    answer_cache_similarity: float | None = option(
        None, "with --answer-cache semantic only: least cosine similarity of the last user messages for a hit "
        "(default: 0.9)", type=float)
    replicas: int = option(1, "engine replicas, each with its own --threads and KV cache; more than 1 serves them "
                           "on Ray Serve (pip install 'leanserve[ray]') behind --replica-router", type=int)
    ray_address: str | None = option(None, "with --replicas > 1: join this Ray cluster (e.g. 'auto' or "
                                     "'ray://HEAD:10001') instead of starting Ray on this machine", metavar="ADDR")
    replica_router: str = option("cache_aware", "with --replicas > 1: which replica takes a request (cache_aware: "
                                 "the longest routed prompt prefix unless loads are imbalanced)",
                                 choices=REPLICA_ROUTERS)
    # model routing (leanserve/routing): the virtual model "auto"
    model_router: str | None = option(
        None, "serve the virtual model 'auto', which picks a real model per request: rules, learned:EXAMPLES.jsonl "
        "(lines {\"text\": ..., \"label\": \"easy\"|\"hard\"}) or cascade[:MIN_MEAN_LOGPROB]", metavar="POLICY")
    strong_share: float | None = option(
        None, "--model-router learned: calibrate its threshold so that this share of requests (0-1) goes to the "
        "strong model (default: threshold 0.5)", type=float, metavar="SHARE")
    model_routers_file: str | None = option(
        None, "JSON or YAML file of named routers, each served as a virtual model: [{\"name\": ..., \"policy\": "
        "\"rules\"|\"learned\"|\"cascade\", \"cheap\": MODEL, \"strong\": MODEL, ...parameters}]", metavar="PATH")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, list | tuple):  # repeated --served-model-name; one stays a str
            names = list(self.served_model_name)
            if any(not isinstance(n, str) or not n.strip() for n in names):
                raise InvalidParameterError("served_model_name", "served_model_name must be a non-empty string")
            self.served_model_name = names[0] if len(names) == 1 else names
        if self.model_router is not None and (not isinstance(self.model_router, str)
                                              or self.model_router.split(":", 1)[0] not in ROUTER_POLICIES):
            raise InvalidParameterError("model_router", f"model_router must be POLICY or POLICY:ARG with POLICY one "
                                        f"of {', '.join(ROUTER_POLICIES)}; got {self.model_router!r}")
        if self.strong_share is not None and (isinstance(self.strong_share, bool)
                                              or not isinstance(self.strong_share, int | float)
                                              or not 0.0 <= self.strong_share <= 1.0):
            raise InvalidParameterError("strong_share", f"strong_share must be in [0, 1], got {self.strong_share!r}")
        for name in ("max_prompt_tokens", "max_context_tokens", "top_k_documents"):
            _check_int(name, getattr(self, name), 1, optional=True)
        _check_int("history_summary_tokens", self.history_summary_tokens, 0, optional=True)
        _check_choice("answer_cache", self.answer_cache, ANSWER_CACHE_MODES)
        _check_int("answer_cache_bytes", self.answer_cache_bytes, 1, optional=True)
        if self.answer_cache_ttl is not None:
            _check_seconds("answer_cache_ttl", self.answer_cache_ttl, positive=True)
        for name in ("answer_cache_bytes", "answer_cache_ttl"):
            if getattr(self, name) is not None and self.answer_cache == "off":
                raise InvalidParameterError(name, f"{name} applies to the answer cache only; answer_cache is 'off' "
                                            "(set it to 'exact' or 'semantic', or drop the option)")
        sim = self.answer_cache_similarity
        if sim is not None and (isinstance(sim, bool) or not isinstance(sim, int | float) or not 0.0 < sim <= 1.0):
            raise InvalidParameterError("answer_cache_similarity", f"answer_cache_similarity must be in (0, 1], got "
                                        f"{sim!r}")
        if sim is not None and self.answer_cache != "semantic":
            raise InvalidParameterError("answer_cache_similarity", "answer_cache_similarity applies to the semantic "
                                        f"answer cache only; answer_cache is {self.answer_cache!r} (set it to "
                                        "'semantic', or drop the similarity)")
        _check_int("port", self.port, 0)
        _check_int("replicas", self.replicas, 1)
        _check_choice("replica_router", self.replica_router, REPLICA_ROUTERS)
        if self.port > 65535:
            raise InvalidParameterError("port", f"port must be in 0-65535, got {self.port}")
        _check_int("max_waiting", self.max_waiting, 1)
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        for key in self.api_keys:
            if not isinstance(key, str) or not key.strip():
                raise InvalidParameterError("api_key", "api_key must be a non-empty string")
        for name in ("tenant_max_concurrent", "tenant_requests_per_minute", "tenant_tokens_per_minute"):
            _check_int(name, getattr(self, name), 1, optional=True)
        _check_int("max_request_bytes", self.max_request_bytes, 1024)
        _check_seconds("shutdown_timeout", self.shutdown_timeout, positive=False)
        _check_seconds("request_timeout", self.request_timeout, positive=True, optional=True)
        _check_seconds("engine_stall_timeout", self.engine_stall_timeout, positive=True)

    @property
    def served_model_names(self) -> list[str]:
        """The names given with ``--served-model-name`` (none, one or several), in order."""
        if self.served_model_name is None:
            return []
        return [self.served_model_name] if isinstance(self.served_model_name, str) else list(self.served_model_name)

    @property
    def api_keys(self) -> list[str]:
        """The keys given with ``--api-key`` (one or several), in order."""
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)


def _check_seconds(name: str, value: Any, *, positive: bool, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InvalidParameterError(name, f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise InvalidParameterError(name, f"{name} must be {'> 0' if positive else '>= 0'} seconds, got {value}")


C = TypeVar("C")


def _dest(f) -> str:
    return f.metadata["dest"] or f.name


def flag_of(cls: type, name: str) -> str | None:
    """The command-line flag of the config field ``name`` (e.g. ``num_threads`` -> ``--threads``), or None."""
    for f in fields(cls):
        if f.name == name and f.metadata.get("cli", False):
            return f.metadata["flag"] or "--" + f.name.replace("_", "-")
    return None


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    repeat: tuple[str, ...] = ()) -> None:
    """Add one flag per field of the config dataclass ``cls`` (``--field-name`` unless the field says otherwise),
    with the field's default (shown in the help), type, choices and help. The fields named in ``repeat`` may be
    given several times (their value is then the list, None when absent), e.g. ``--model`` of ``serve``."""
    for f in fields(cls):
        meta = f.metadata
        if not meta.get("cli", False):
            continue
        default = f.default if f.default is not MISSING else None
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        names = [flag, *meta["aliases"]]
        help_text = meta["help"]
        if default is not None and not isinstance(default, bool) and "default" not in help_text:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": _dest(f), "default": default, "help": help_text}
        if isinstance(default, bool):
            kwargs["action"] = "store_false" if default else "store_true"
        else:
            if meta.get("repeat") or f.name in repeat:
                kwargs["action"] = "append"
            if meta["type"] is not None:
                kwargs["type"] = meta["type"]
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
            if meta["metavar"] is not None:
                kwargs["metavar"] = meta["metavar"]
        parser.add_argument(*names, **kwargs)


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    """An instance of the config dataclass ``cls`` from the flags :func:`add_config_args` added.

    Raises:
        InvalidParameterError: a value the dataclass refuses.
    """
    return cls(**{f.name: getattr(args, _dest(f)) for f in fields(cls) if f.metadata.get("cli", False)})
