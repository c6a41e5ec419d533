"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2) over a flattened batch of tokens.

No padded rectangles: the tokens of every scheduled sequence are concatenated into one ``[T]`` vector with their
absolute positions; attention keeps sequences apart through :class:`AttentionMetadata`. The math matches Hugging
Face ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half RoPE, SwiGLU MLP); Q/K/V and gate/up projections are
fused into one matmul each.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from leanserve.config import ModelConfig
from leanserve.errors import UnsupportedQuantizationError
from leanserve.kernels import native_ops
from leanserve.model.attention import AttentionMetadata, KVCache, paged_attention
from leanserve.model.rope import RotaryEmbedding, apply_rope
from leanserve.quantization import check_quantization
from leanserve.quantization.weights import (
    BLOCK_KERNEL_MAX_ROWS,
    BlockQuantWeight,
    GroupQuantized,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantize_weight,
)

import torch
import torch.nn.functional as F

# Rows above which a bf16 matmul is run in fp32: this CPU has no bf16 GEMM path (a batched bf16 GEMM runs at
# ~0.3 GFLOP/s), while a bf16 matrix-vector product is fast (half the bytes of fp32).
_BF16_GEMM_MAX_ROWS = 8


def numpy_blas_enabled() -> bool:
    """Whether fp32 CPU matmuls may use NumPy's BLAS: only when OpenMP waits passively (see leanserve/__init__)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


_NUMPY_BLAS = numpy_blas_enabled()
_EMPTY = torch.empty(0)  # "no residual to add" for the fused RMSNorm


# Fewest rows given to BLAS gemm in batch-invariant mode. OpenBLAS computes a row of x @ w.T bitwise the same
# for every M >= 3 (checked for this model's shapes up to M = 200: tests/model/test_batch_invariance.py), but gemv
# (M = 1) and, for some shapes, gemm at M = 2 round differently; so smaller inputs are zero-padded to this.
_INVARIANT_MIN_ROWS = 3


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None,
           min_rows: int = 0, kernel_rows: int | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for x [T, in] and w [out, in], choosing the fast kernel for the dtype and T.

    A quantized ``w`` (:class:`Int8Weight` / :class:`Int4Weight`) runs its own packed kernel (see
    :mod:`leanserve.quantization.weights`).

    On CPU, fp32 products go through NumPy's BLAS (OpenBLAS) when :func:`numpy_blas_enabled`: on this class of
    CPU it streams weights at ~19 GB/s in a matrix-vector product where torch's MKL path reaches ~11 GB/s, and it
    is as fast or faster for GEMMs (see benchmarks/decode.py). bf16 products with more than a few rows run in fp32
    (no fast bf16 GEMM on CPU). ``min_rows`` > T zero-pads x to that many rows for a GEMM (batch-invariant mode
    of the NumPy path: every row then goes through the same kernel whatever T is).

    A :class:`BlockQuantWeight` in lane layout runs its lane kernel on all rows (each row's result independent of
    the others). In file layout it runs its block kernel on the first ``kernel_rows`` rows (decode tokens; None:
    all) when there are at most ``BLOCK_KERNEL_MAX_ROWS`` of them, and dequantizes to fp32 for a GEMM on the others
    (prefill tokens: always that path, so a prompt token's result does not depend on how the prompt was chunked or
    how much of it came from the prefix cache). With ``min_rows`` (batch-invariant mode) every row runs the block
    kernel.
    """
    if isinstance(w, BlockQuantWeight):
        t = x.shape[0]
        row_invariant = w.lanes or min_rows  # every row through the kernel
        n = t if row_invariant or kernel_rows is None else kernel_rows  # leading rows that may run the kernel
        if not row_invariant and n > BLOCK_KERNEL_MAX_ROWS:
            n = 0
        xf = x if x.dtype == torch.float32 else x.float()
        if n == t:
            y = w.kernel(xf)
        elif n == 0:
            y = linear(xf, w.dequantize(use_scratch=True))
        else:
            y = torch.cat([w.kernel(xf[:n]), linear(xf[n:], w.dequantize(use_scratch=True))])
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if b is None else y + b
    if isinstance(w, Int8Weight | Int4Weight):
        y = w.matmul(x)
        return y if b is None else y + b
    if x.device.type == "cpu":
        if _NUMPY_BLAS and w.dtype == torch.float32 and x.dtype == torch.float32:
            wn = w.numpy()
            t = x.shape[0]
            if t < min_rows:
                xp = torch.zeros(min_rows, x.shape[1])
                xp[:t] = x
                y = torch.from_numpy(xp.numpy() @ wn.T)[:t]  # BLAS gemm on padded rows
            elif t == 1:
                y = torch.from_numpy(wn @ x.numpy()[0]).unsqueeze(0)  # BLAS gemv
            else:
                y = torch.from_numpy(x.numpy() @ wn.T)  # BLAS gemm
            return y if b is None else y + b
        if w.dtype == torch.bfloat16 and x.shape[0] > _BF16_GEMM_MAX_ROWS:
            bias = None if b is None else b.float()
            return F.linear(x.float(), w.float(), bias).to(torch.bfloat16)
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) computed in fp32 as HF does; x [T, hidden], weight [hidden]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    """Weights of one decoder layer, ``[out, in]`` like ``nn.Linear``; the projections may be quantized."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | QuantizedWeight  # [(num_heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * kv_heads) * head_dim] (Qwen2) or None
    o: torch.Tensor | QuantizedWeight  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | QuantizedWeight  # [2 * intermediate, hidden]
    down: torch.Tensor | QuantizedWeight  # [hidden, intermediate]


class LlamaModel:
    """The decoder with its weights, in ``dtype`` on ``device``.

    Args:
        config: architecture.
        weights: HF-named, HF-layout tensors (see ``leanserve.loader``), projections possibly
            :class:`GroupQuantized`; consumed (fused copies are kept).
        dtype: torch.float32 or torch.bfloat16 (activations, norms, embedding and float weights).
        device: torch device.
        max_position: positions to precompute RoPE for (tokens).
        quantization: "auto", "none", "int8" or "int4" for the projections (see
            :func:`leanserve.quantization.weights.quantize_weight`). Under "auto" with ``native_kernels``, GGUF
            Q4_0/Q4_1/Q8_0 matrices, the token embedding and the (tied) output projection included, stay in their
            file layout and run leanserve's block kernel (fp32 output). Otherwise the embedding and the output
            projection stay float: torch's packed kernels return bf16, whose spacing is 0.125 at logits of 16-32, and
            with an int8 output projection ``leanserve eval`` saw the greedy first token change on 10-15% of
            prompts (near-ties), against 3% with int8 projections and a float output projection.
        group_size: int4 group size (input columns per scale): 32, 64 or 128.
        batch_invariant: compute every token's row with the same kernels whatever the batch holds, so its logits
            are bitwise independent of the batch (float32 activations on CPU with NumPy's BLAS; the packed int8/int4
            kernels are row-invariant already; decode at batch 1-2 is slower: GEMMs on zero-padded rows, not gemv).
        native_kernels: use the compiled block kernel for GGUF-quantized weights and the fused RMSNorm / RoPE
            (float32 on CPU) when they build (``leanserve.kernels``); else torch's packed int4/int8 kernels and
            eager torch ops.

    Raises:
        KeyError: when a required weight is missing from ``weights``.
        UnsupportedQuantizationError: unknown method or group size, a group size that does not divide a layer's
            input width, or quantized weights on a device other than the CPU.
        ValueError: ``batch_invariant`` with a dtype, device or BLAS path that cannot provide it.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | GroupQuantized],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_position: int | None = None, quantization: str = "none", group_size: int = 32,
                 batch_invariant: bool = False, native_kernels: bool = True) -> None:
        check_quantization(quantization, group_size)
        block_ext = native_ops() if native_kernels and torch.device(device).type == "cpu" else None
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        self.batch_invariant = batch_invariant
        if batch_invariant and (dtype != torch.float32 or self.device.type != "cpu" or not _NUMPY_BLAS):
            raise ValueError("batch_invariant needs float32 on CPU with NumPy's BLAS (OMP_WAIT_POLICY=PASSIVE); "
                             f"got {dtype} on {self.device.type}")
        self._min_rows = _INVARIANT_MIN_ROWS if batch_invariant else 0

        def w(name: str) -> torch.Tensor:
            t = weights[name]
            t = t.dequantize() if isinstance(t, GroupQuantized) else t
            return t.to(device=self.device, dtype=dtype).contiguous()

        def proj(*names: str) -> torch.Tensor | QuantizedWeight:
            """The projections ``names`` fused along output rows, quantized per ``quantization``."""
            parts = [weights[n] for n in names]
            if all(isinstance(p, GroupQuantized) for p in parts) and len({p.kind() for p in parts}) == 1:
                fused = GroupQuantized.cat_rows(parts)
            else:
                fused = torch.cat([p.dequantize() if isinstance(p, GroupQuantized) else p.float() for p in parts])
            q = quantize_weight(fused, quantization, group_size, block_ext)
            if isinstance(q, torch.Tensor):
                return q.to(device=self.device, dtype=dtype).contiguous()
            if self.device.type != "cpu":
                raise UnsupportedQuantizationError(
                    "quantization", f"quantized weights run on the CPU only, not on {self.device.type}")
            return q

        def table(name: str) -> torch.Tensor | BlockQuantWeight:
            """The embedding or output matrix: in its file layout under "auto" with the block kernel, else float."""
            t = weights[name]
            if quantization == "auto" and block_ext is not None and isinstance(t, GroupQuantized):
                return quantize_weight(t, quantization, group_size, block_ext)
            return w(name)

        self.embed = table("model.embed_tokens.weight")  # [vocab, hidden]
        self.lm_head: torch.Tensor | QuantizedWeight = (
            self.embed if config.tie_word_embeddings else table("lm_head.weight"))
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(att + f"{n}_proj.bias") for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=proj(*(att + f"{n}_proj.weight" for n in "qkv")),
                qkv_bias=bias,
                o=proj(att + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=proj(p + "mlp.down_proj.weight"),
            ))
        blocks = [t for layer in self.layers for t in vars(layer).values()
                  if isinstance(t, BlockQuantWeight) and not t.lanes]
        if blocks:  # one dequantization buffer for all layers (large batches), reused so it stays in cache
            scratch = torch.empty(max(b.shape[0] * b.shape[1] for b in blocks))
            for b in blocks:
                b.scratch = scratch
        self.rope = RotaryEmbedding(config.head_dim, max_position or config.max_position_embeddings,
                                    config.rope_theta, config.rope_scaling)
        self.rope.cos = self.rope.cos.to(self.device)
        self.rope.sin = self.rope.sin.to(self.device)
        # fused RMSNorm / RoPE (leanserve/kernels/fused_ops.cpp) for float32 on CPU
        self._fused = (native_ops() if native_kernels and self.device.type == "cpu" and dtype == torch.float32
                       else None)

    def weight_bytes(self) -> int:
        """Bytes held by the model's weights (the tied output matrix counted once; quantized ones as packed)."""
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size() for t in tensors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[KVCache, KVCache]], meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over a flattened batch.

        Args:
            input_ids: [T] int64 token ids.
            positions: [T] int64 absolute positions of those tokens in their sequences.
            kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim] (float or int8).
            meta: attention metadata of this step.

        Returns:
            [T, hidden] final hidden states (after the last RMSNorm), in the model dtype.
        """
        cfg = self.config
        t = input_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        fused = self._fused
        if fused is not None:
            cos, sin = self.rope.cos[positions], self.rope.sin[positions]  # [T, head_dim] each
        else:
            cos, sin = self.rope.cos_sin(positions, self.dtype)  # [T, 1, head_dim]
        x = self.embed_tokens(input_ids).contiguous()  # [T, hidden], the residual stream (updated in place)
        pending: torch.Tensor | None = None  # the MLP output still to be added to x
        lin = functools.partial(linear, min_rows=self._min_rows, kernel_rows=meta.num_decode_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = self._add_norm(x, pending, layer.input_norm)
            qkv = lin(h, layer.qkv, layer.qkv_bias)  # [T, q_size + 2 * kv_size]
            if fused is not None:
                fused.rope_(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(t, cfg.num_heads, cfg.head_dim)
            k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
            if fused is None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, num_heads, head_dim]
            h = self._add_norm(x, lin(attn.view(t, q_size), layer.o), layer.post_norm)
            gate, up = lin(h, layer.gate_up).chunk(2, dim=-1)  # [T, intermediate] each
            pending = lin(F.silu(gate) * up, layer.down)
        return self._add_norm(x, pending, self.norm)

    def _add_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """``x += y`` in place (the residual add; ``y`` None: none), then RMSNorm(x) * weight. x, y: [T, hidden]."""
        if self._fused is not None:
            return self._fused.add_rms_norm_(x, _EMPTY if y is None else y.contiguous(), weight,
                                             self.config.rms_norm_eps)
        if y is not None:
            x += y
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [T, hidden] in the model dtype for ids [T] int64."""
        if isinstance(self.embed, BlockQuantWeight):
            return self.embed.rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] float32 for hidden states [N, hidden]."""
        return linear(hidden, self.lm_head, min_rows=self._min_rows).float()
