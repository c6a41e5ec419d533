"""Gemma 3 decoder (``Gemma3ForCausalLM``, text only) over a flattened batch of tokens, on the paged KV cache.

The same interface as :class:`leanserve.model.llama.LlamaModel` (``forward``, ``compute_logits``, ``config``,
``dtype``, ``device``, ``batch_invariant``, ``weight_bytes``), so the runner, scheduler and engine are shared. The
math is transformers' ``modeling_gemma3`` (Gemma Team, "Gemma 3 Technical Report", 2025):

* the embedding scaled by ``sqrt(hidden_size)`` (rounded to the model dtype); the output head tied to it;
* RMSNorm in fp32 multiplying by ``1 + weight``: before and after attention, before and after the MLP
  (``x = x + post_norm(attn(pre_norm(x)))``, the same for the MLP), and on the final hidden state;
* QK-norm: RMSNorm over each head's ``head_dim`` of q and k (``1 + weight``), before RoPE (rotate-half);
* attention scaled by ``query_pre_attn_scalar**-0.5``; GQA;
* interleaved layers: ``config.layer_types[i] == "sliding_attention"`` sees the last ``sliding_window`` keys
  (:mod:`leanserve.model.sliding_window`) with RoPE base ``rope_local_theta``; global layers see every key, RoPE
  base ``rope_theta`` (with ``rope_scaling``);
* the MLP ``down(gelu_tanh(gate(x)) * up(x))``.

Weights are as :func:`leanserve.loader.gguf_gemma3.gemma3_weights` returns them (norms as HF's ``w``). Under
``quantization="auto"`` with the native kernels every matrix of the Q4_K_M file runs a native kernel on its file
values: the Q8_0 embedding (also the output head) and the Q5_0 projections (held exactly as 8-bit codes, fused
with the Q8_0 v projection) on the block kernels, Q4_K / Q6_K (o_proj, down_proj) on ``kquant_gemm``
(:class:`leanserve.quantization.kquant.KQuantWeight`). Other methods dequantize to float first.
"""

from __future__ import annotations

import math
from dataclasses import replace

from leanserve.config import ModelConfig
from leanserve.errors import UnsupportedQuantizationError
from leanserve.kernels import native_ops
from leanserve.model.attention import AttentionMetadata, KVCache, paged_attention
from leanserve.model.rope import RotaryEmbedding, apply_rope
from leanserve.model.sliding_window import sliding_window_attention, sliding_window_metadata
from leanserve.quantization import check_quantization
from leanserve.quantization.kquant import KQuantWeight
from leanserve.quantization.weights import (
    BlockQuantWeight,
    FloatWeight,
    GroupQuantized,
    LinearWeight,
    quantize_weight,
)

import torch
import torch.nn.functional as F


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim: ``x / rms(x) * scale`` in fp32, cast back to x's dtype.

    ``scale`` is ``1 + weight`` already (fp32), as transformers' ``Gemma3RMSNorm`` computes it.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale).to(x.dtype)


class Gemma3Layer:
    """One decoder layer's weights: norm scales (``1 + w``, fp32), fused projections, its attention kind."""

    __slots__ = ("input_norm", "q_norm", "k_norm", "qkv", "o", "post_attn_norm", "pre_ffn_norm", "gate_up", "down",
                 "post_ffn_norm", "sliding")

    def __init__(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class Gemma3Model:
    """The Gemma 3 decoder with its weights, in ``dtype`` on ``device``.

    Args:
        config: architecture (``architecture == "gemma3"``, with ``layer_types``, ``sliding_window``,
            ``rope_local_theta`` and ``query_pre_attn_scalar``).
        weights: HF-named tensors (:func:`leanserve.loader.gguf_gemma3.gemma3_weights`), matrices possibly
            :class:`GroupQuantized`.
        dtype, device, max_position, quantization, group_size, batch_invariant, native_kernels: as for
            :class:`leanserve.model.llama.LlamaModel`.

    Raises:
        KeyError: a weight is missing. ValueError: not a Gemma 3 config, or ``batch_invariant`` (not offered).
        UnsupportedQuantizationError: as for ``LlamaModel``.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | GroupQuantized],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_position: int | None = None, quantization: str = "none", group_size: int = 32,
                 batch_invariant: bool = False, native_kernels: bool = True) -> None:
        if config.architecture != "gemma3" or config.layer_types is None:
            raise ValueError(f"Gemma3Model needs a gemma3 config, got {config.architecture!r}")
        if batch_invariant:
            raise ValueError("batch_invariant is not offered for Gemma 3")
        check_quantization(quantization, group_size)
        block_ext = native_ops() if native_kernels and torch.device(device).type == "cpu" else None
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        self.batch_invariant = False
        self._invariant_rows = 0

        def scale(name: str) -> torch.Tensor:  # a norm's 1 + w, fp32, as Gemma3RMSNorm computes it
            return (1.0 + weights[name].float()).to(self.device)

        def proj(*names: str) -> LinearWeight:
            parts = [weights[n] for n in names]
            if len(parts) == 1 and isinstance(parts[0], KQuantWeight):  # Q4_K / Q6_K: the native kernel under auto
                if quantization == "auto" and block_ext is not None and hasattr(block_ext, "kquant_gemm"):
                    return replace(parts[0], ext=block_ext)
                parts = [parts[0].dequantize()]
            if all(isinstance(p, GroupQuantized) for p in parts) and len({p.kind() for p in parts}) == 1:
                fused = GroupQuantized.cat_rows(parts)
            else:
                fused = torch.cat([p.dequantize() if isinstance(p, GroupQuantized | KQuantWeight) else p.float()
                                   for p in parts])
            q = quantize_weight(fused, quantization, group_size, block_ext)
            if isinstance(q, torch.Tensor):
                return FloatWeight(q.to(device=self.device, dtype=dtype).contiguous(), block_ext)
            if self.device.type != "cpu":
                raise UnsupportedQuantizationError(
                    "quantization", f"quantized weights run on the CPU only, not on {self.device.type}")
            return q

        emb = weights["model.embed_tokens.weight"]
        if quantization == "auto" and block_ext is not None and isinstance(emb, GroupQuantized):
            self.embed: BlockQuantWeight | FloatWeight = quantize_weight(emb, quantization, group_size, block_ext)
        else:
            emb = emb.dequantize() if isinstance(emb, GroupQuantized) else emb
            self.embed = FloatWeight(emb.to(device=self.device, dtype=dtype).contiguous(), block_ext)
        self.lm_head: LinearWeight = self.embed
        # transformers: embed_scale = hidden**0.5 as a float32 tensor, cast to the weight's dtype
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32).to(dtype)
        self.norm = scale("model.norm.weight")
        self.layers: list[Gemma3Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            self.layers.append(Gemma3Layer(
                input_norm=scale(p + "input_layernorm.weight"),
                q_norm=scale(att + "q_norm.weight"),
                k_norm=scale(att + "k_norm.weight"),
                qkv=proj(*(att + f"{n}_proj.weight" for n in "qkv")),
                o=proj(att + "o_proj.weight"),
                post_attn_norm=scale(p + "post_attention_layernorm.weight"),
                pre_ffn_norm=scale(p + "pre_feedforward_layernorm.weight"),
                gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=proj(p + "mlp.down_proj.weight"),
                post_ffn_norm=scale(p + "post_feedforward_layernorm.weight"),
                sliding=config.is_sliding(i),
            ))
        n_pos = max_position or config.max_position_embeddings
        self.rope_global = RotaryEmbedding(config.head_dim, n_pos, config.rope_theta, config.rope_scaling)
        self.rope_local = RotaryEmbedding(config.head_dim, n_pos, config.rope_local_theta or config.rope_theta, None)
        for rope in (self.rope_global, self.rope_local):
            rope.cos, rope.sin = rope.cos.to(self.device), rope.sin.to(self.device)
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.scale = float(scalar) ** -0.5
        # paged_attention scales by head_dim**-0.5: global layers' queries are pre-multiplied by the ratio
        self._q_ratio = None if scalar == config.head_dim else (config.head_dim / float(scalar)) ** 0.5

    def weight_bytes(self) -> int:
        """Bytes held by the weights (the tied output counted once; quantized ones as packed)."""
        held = [self.embed, self.norm]
        for layer in self.layers:
            held += [getattr(layer, s) for s in Gemma3Layer.__slots__ if s != "sliding"]
        return sum(t.nbytes for t in held)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled embedding rows [T, hidden] in the model dtype for ids [T] int64."""
        return self.embed.rows(input_ids).to(self.dtype) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[KVCache, KVCache]], meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over a flattened batch (arguments as ``LlamaModel.forward``).

        Returns:
            [T, hidden] final hidden states (after the final norm), in the model dtype.
        """
        cfg = self.config
        t = input_ids.shape[0]
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q_size, kv_size = nh * hd, nkv * hd
        eps = cfg.rms_norm_eps
        rope = {False: self.rope_global.cos_sin(positions, self.dtype),  # by layer.sliding
                True: self.rope_local.cos_sin(positions, self.dtype)}
        local = None
        if any(layer.sliding for layer in self.layers):
            block_size = kv_caches[0][0].shape[1]
            local = sliding_window_metadata(meta, cfg.sliding_window, block_size)
        x = self.embed_tokens(input_ids)  # [T, hidden], the residual stream
        kr, rr = meta.num_decode_tokens, meta.recomputed_rows
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = gemma_rms_norm(x, layer.input_norm, eps)
            qkv = layer.qkv.matmul(h, kernel_rows=kr, recomputed_rows=rr)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = gemma_rms_norm(q.reshape(t, nh, hd), layer.q_norm, eps)
            k = gemma_rms_norm(k.reshape(t, nkv, hd), layer.k_norm, eps)
            cos, sin = rope[layer.sliding]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(t, nkv, hd)
            if layer.sliding:
                attn = sliding_window_attention(q, k, v, k_cache, v_cache, local, self.scale)
            else:
                attn = paged_attention(q if self._q_ratio is None else q * self._q_ratio, k, v, k_cache, v_cache,
                                       meta)
            o = layer.o.matmul(attn.reshape(t, q_size), kernel_rows=kr, recomputed_rows=rr)
            x = x + gemma_rms_norm(o, layer.post_attn_norm, eps)
            h = gemma_rms_norm(x, layer.pre_ffn_norm, eps)
            gate, up = layer.gate_up.matmul(h, kernel_rows=kr, recomputed_rows=rr).chunk(2, dim=-1)
            m = layer.down.matmul(F.gelu(gate, approximate="tanh") * up, kernel_rows=kr, recomputed_rows=rr)
            x = x + gemma_rms_norm(m, layer.post_ffn_norm, eps)
        return gemma_rms_norm(x, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] float32 for hidden states [N, hidden] (the tied embedding as output head)."""
        if hidden.shape[0] == 0:  # the block kernels need at least one row
            return torch.empty(0, self.config.vocab_size)
        return self.lm_head.matmul(hidden).float()
