"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2) over a flattened batch of tokens.

No padded rectangles: the tokens of every scheduled sequence are concatenated into one ``[T]`` vector with their
absolute positions; attention keeps sequences apart through :class:`AttentionMetadata`. The math matches Hugging
Face ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half RoPE, SwiGLU MLP); Q/K/V and gate/up projections are
fused into one matmul each. Every projection, the output head included, is a
:class:`leanserve.quantization.weights.LinearWeight` that picks its own kernel: the model only passes each matmul
the step's shape (``kernel_rows``: its leading decode tokens) and, in batch-invariant mode, ``invariant_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass

from leanserve.config import ModelConfig
from leanserve.errors import UnsupportedQuantizationError
from leanserve.kernels import native_ops, use_streaming_prefetch
from leanserve.model.attention import AttentionMetadata, KVCache, paged_attention
from leanserve.model.fused_decode import FusedDecode
from leanserve.model.rope import RotaryEmbedding, apply_rope
from leanserve.quantization import check_quantization
from leanserve.quantization.weights import (
    INVARIANT_ROWS,
    BlockQuantWeight,
    FloatWeight,
    GroupQuantized,
    LinearWeight,
    numpy_blas_enabled,
    quantize_weight,
)

import torch
import torch.nn.functional as F

_NUMPY_BLAS = numpy_blas_enabled()
_EMPTY = torch.empty(0)  # "no residual to add" for the fused RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) computed in fp32 as HF does; x [T, hidden], weight [hidden]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    """Weights of one decoder layer: norms as tensors, projections as :class:`LinearWeight` ``[out, in]``."""

    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [(num_heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * kv_heads) * head_dim] (Qwen2) or None
    o: LinearWeight  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    down: LinearWeight  # [hidden, intermediate]


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
            projection stay float (:class:`FloatWeight`): torch's packed kernels return bf16, whose spacing is 0.125
            at logits of 16-32, enough to flip the greedy token on near-ties (``leanserve eval`` measures it).
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
        self._invariant_rows = INVARIANT_ROWS if batch_invariant else 0  # every matmul's invariant_rows

        def w(name: str) -> torch.Tensor:
            t = weights[name]
            t = t.dequantize() if isinstance(t, GroupQuantized) else t
            return t.to(device=self.device, dtype=dtype).contiguous()

        def proj(*names: str) -> LinearWeight:
            """The projections ``names`` fused along output rows, quantized per ``quantization``."""
            parts = [weights[n] for n in names]
            if all(isinstance(p, GroupQuantized) for p in parts) and len({p.kind() for p in parts}) == 1:
                fused = GroupQuantized.cat_rows(parts)
            else:
                fused = torch.cat([p.dequantize() if isinstance(p, GroupQuantized) else p.float() for p in parts])
            q = quantize_weight(fused, quantization, group_size, block_ext)
            if isinstance(q, torch.Tensor):
                return FloatWeight(q.to(device=self.device, dtype=dtype).contiguous(), block_ext)
            if self.device.type != "cpu":
                raise UnsupportedQuantizationError(
                    "quantization", f"quantized weights run on the CPU only, not on {self.device.type}")
            return q

        def table(name: str) -> BlockQuantWeight | FloatWeight:
            """The embedding or output matrix: in its file layout under "auto" with the block kernel, else float."""
            t = weights[name]
            if quantization == "auto" and block_ext is not None and isinstance(t, GroupQuantized):
                return quantize_weight(t, quantization, group_size, block_ext)
            return FloatWeight(w(name), block_ext)

        # [vocab, hidden]; rows() is the lookup, matmul() the (tied) output head
        self.embed: BlockQuantWeight | FloatWeight = table("model.embed_tokens.weight")
        self.lm_head: LinearWeight = self.embed if config.tie_word_embeddings else table("lm_head.weight")
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
        # fused RMSNorm / RoPE / SwiGLU (leanserve/kernels/fused_ops.cpp) for float32 on CPU
        self._fused = (native_ops() if native_kernels and self.device.type == "cpu" and dtype == torch.float32
                       else None)
        # decode-only steps in one native call (bitwise equal to the per-op path); None: the per-op path
        self.fused_decode: FusedDecode | None = FusedDecode.build(self)
        if self._fused is not None:  # weights larger than the L3 stream through it: non-temporal prefetch
            use_streaming_prefetch(self.weight_bytes())

    def weight_bytes(self) -> int:
        """Bytes held by the model's weights (the tied output matrix counted once; quantized ones as packed)."""
        held = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            held += [t for t in vars(layer).values() if t is not None]
        return sum(t.nbytes for t in held)  # torch.Tensor.nbytes and LinearWeight.nbytes

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
        if self.fused_decode is not None and self.fused_decode.applies(t, kv_caches, meta):
            return self.fused_decode.forward(x, cos, sin, kv_caches, meta)
        pending: torch.Tensor | None = None  # the MLP output still to be added to x
        # each matmul's kernel_rows, invariant_rows and recomputed_rows
        kr, mr, rr = meta.num_decode_tokens, self._invariant_rows, meta.recomputed_rows
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = self._add_norm(x, pending, layer.input_norm)
            # [T, q_size + 2 * kv_size]
            qkv = layer.qkv.matmul(h, layer.qkv_bias, kernel_rows=kr, invariant_rows=mr, recomputed_rows=rr)
            if fused is not None:
                fused.rope_(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(t, cfg.num_heads, cfg.head_dim)
            k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
            if fused is None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, num_heads, head_dim]
            o = layer.o.matmul(attn.view(t, q_size), kernel_rows=kr, invariant_rows=mr, recomputed_rows=rr)
            h = self._add_norm(x, o, layer.post_norm)
            gu = layer.gate_up.matmul(h, kernel_rows=kr, invariant_rows=mr, recomputed_rows=rr)  # [T, 2 * inter]
            pending = layer.down.matmul(self._swiglu(gu), kernel_rows=kr, invariant_rows=mr, recomputed_rows=rr)
        return self._add_norm(x, pending, self.norm)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, inter] of the fused gate|up product ``gu`` [T, 2 * inter] (gate first)."""
        if self._fused is not None:
            return self._fused.silu_mul(gu.contiguous())
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

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
        return self.embed.rows(input_ids).to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] float32 for hidden states [N, hidden] (all rows alike: no ``kernel_rows``)."""
        return self.lm_head.matmul(hidden, invariant_rows=self._invariant_rows).float()
