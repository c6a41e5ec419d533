"""Fused decode: a Llama model's decoder layers for a decode-only step in one native call.

:class:`FusedDecode` hands the layers' weights once to the compiled ``DecodeLayers``
(leanserve/kernels/decode_layers.cpp), which then runs a whole decode step's layers (add+RMSNorm, qkv, RoPE, KV
write, paged decode attention, o, add+RMSNorm, gate_up, SiLU*mul, down, final RMSNorm) with the same kernels, shapes
and order as :meth:`leanserve.model.llama.LlamaModel.forward`'s per-op path: its hidden states are bitwise equal to
that path's, and only the Python and torch dispatch between the kernels is saved.

It applies to float32 models on CPU whose projections are all lane-layout :class:`BlockQuantWeight`\\ s (GGUF
Q4_0 / Q4_1 / Q8_0 under ``--quantization auto``), with a float32 or float16 paged KV cache and the native decode
attention, on steps that hold decodes only (one decode group; prefill chunks take the per-op path).
``LEANSERVE_FUSED_DECODE=0`` turns it off (the per-op path everywhere).
"""

from __future__ import annotations

import os
from typing import Any

from leanserve.model.attention import AttentionMetadata, KVCache
from leanserve.quantization.weights import BlockQuantWeight

import torch

FUSED_DECODE_ENV = "LEANSERVE_FUSED_DECODE"
_EMPTY = torch.empty(0)
_EMPTY_F16 = torch.empty(0, dtype=torch.float16)


def fused_decode_enabled() -> bool:
    """False when ``$LEANSERVE_FUSED_DECODE`` is "0" (or "false", "off", "no")."""
    return os.environ.get(FUSED_DECODE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class FusedDecode:
    """The compiled decoder layers of one model (see the module docstring). Build with :meth:`build`."""

    def __init__(self, model: Any, ext: Any) -> None:
        """``model``: a :class:`leanserve.model.llama.LlamaModel` (not imported here: it imports this module)."""
        cfg = model.config
        layers, bits = [], []
        for layer in model.layers:
            projs = (layer.qkv, layer.o, layer.gate_up, layer.down)
            tensors = [layer.input_norm, layer.post_norm]
            for i, p in enumerate(projs):
                tensors += [p.codes, p.d, p.mn if p.mn is not None else _EMPTY_F16]
                if i == 0:
                    tensors.append(layer.qkv_bias.float().contiguous() if layer.qkv_bias is not None else _EMPTY)
            layers.append(tensors)
            bits.append([p.bits for p in projs])
        self._native = ext.DecodeLayers(layers, bits, model.norm, cfg.rms_norm_eps, cfg.num_heads,
                                        cfg.num_kv_heads, cfg.head_dim)
        self._scale = cfg.head_dim ** -0.5
        self._caches: list[tuple[KVCache, KVCache]] | None = None

    @classmethod
    def build(cls, model: Any) -> FusedDecode | None:
        """The fused layers of ``model``, or None where they do not apply (not float32 on CPU with the native
        kernels, a projection that is not a lane-layout :class:`BlockQuantWeight`, an extension without
        ``DecodeLayers``, or ``$LEANSERVE_FUSED_DECODE`` off)."""
        ext = model._fused  # the native extension, set for float32 on CPU with native kernels
        if not fused_decode_enabled() or ext is None or not hasattr(ext, "DecodeLayers"):
            return None
        for layer in model.layers:
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if not (isinstance(p, BlockQuantWeight) and p.lanes):
                    return None
        return cls(model, ext)

    def applies(self, t: int, kv_caches: list[tuple[KVCache, KVCache]], meta: AttentionMetadata) -> bool:
        """Whether a step of ``t`` tokens runs here: decodes only, in one group, with the native decode attention
        and float32 or float16 tensor caches."""
        if meta.prefills or len(meta.decode_groups) != 1 or meta.decode_kernel is None or t == 0:
            return False
        if meta.decode_groups[0].count != t:
            return False
        k = kv_caches[0][0]
        return isinstance(k, torch.Tensor) and k.dtype in (torch.float32, torch.float16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[tuple[KVCache, KVCache]], meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, hidden] float32 (after the last RMSNorm) of the embedded decode tokens
        ``x`` [T, hidden] float32 (updated in place: the residual stream), with RoPE tables ``cos``, ``sin``
        [T, head_dim]; writes the step's keys and values into ``kv_caches``. Call only where :meth:`applies`."""
        if kv_caches is not self._caches:
            self._native.set_caches([k for k, _ in kv_caches], [v for _, v in kv_caches])
            self._caches = kv_caches
        g = meta.decode_groups[0]
        return self._native.forward(x, cos, sin, meta.slot_mapping, g.block_table, g.seq_lens, self._scale)

    def set_profiling(self, on: bool) -> None:
        """Time each phase of the native forward from now on (resetting the totals), or stop timing."""
        self._native.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds spent per phase (``"add+RMSNorm"``, ``"qkv GEMM"``, ``"attention"``, ...) summed over the
        forwards since :meth:`set_profiling` turned timing on, and ``"forwards"``: how many there were."""
        return dict(self._native.profile())
