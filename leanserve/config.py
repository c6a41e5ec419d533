"""Configuration dataclasses: the model's architecture and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from GGUF metadata or an HF ``config.json``.

    All sizes are element counts; ``head_dim`` is per attention head.
    """

    architecture: str  # "llama", "mistral" or "qwen2"
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

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes in fp32: 2 (K and V) x layers x KV heads x head dim x 4."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


@dataclass
class EngineConfig:
    """Knobs of the engine (names follow vLLM's engine arguments)."""

    model: str | None = None  # GGUF file or HF folder; None = the default SmolLM2-135M-Instruct
    dtype: str = "float32"  # "float32" or "bfloat16": weights and activations
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = default (see engine)
    max_num_seqs: int = 64  # most requests in one step
    max_num_batched_tokens: int | None = 2048  # token budget of one step; None = unlimited
    max_model_len: int | None = None  # context limit in tokens; None = the model's
    enable_prefix_caching: bool = True
    # Prompts longer than this (tokens) advance at most this much per step (even alone), and
    # only one such prompt prefills at a time. None = auto (256 on CPU, 2048 on CUDA); 0 = no limit.
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority"
    seed: int = 0  # seed of the engine's generator for unseeded sampling
    # CPU threads for matmuls and attention (torch's and NumPy's BLAS pools; llama.cpp's -t); None = all cores.
    # On a machine shared with other busy processes, give fewer threads than cores: a pool that waits on a
    # descheduled thread at every matmul is many times slower.
    num_threads: int | None = None
    # Compiled CPU kernels (leanserve.kernels: paged decode attention), built on first use; False = torch path only.
    use_native_kernels: bool = True
    # Bitwise batch invariance: a request's logits do not depend on what else is in the batch, so seeded sampling
    # gives the same text alone and in any batch. Costs single-stream decode speed (fp32 CPU only; see llama.py).
    batch_invariant: bool = False
    # Weight quantization (leanserve.quantization): "auto" keeps GGUF Q4_0/Q4_1/Q8_0 projections in their native
    # bits (the default Q4_1 model runs at 4 bits), "none" = float weights, "int8" / "int4" quantize at load.
    quantization: str = "auto"
    quantization_group_size: int = 32  # int4 input columns per scale: 32, 64 or 128
    # "auto" = the model dtype; "float16" = 2 bytes per element; "int8" = int8 with a scale per token and KV head
    kv_cache_dtype: str = "auto"
