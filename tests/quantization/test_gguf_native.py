"""GGUF Q4_0 / Q4_1 / Q8_0 tensors loaded natively: exact against gguf-py's dequantization after unpacking."""

from __future__ import annotations

from pathlib import Path

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.loader import default_model_path
from leanserve.loader.gguf_loader import gguf_model_config, gguf_weights, unpermute_qk
from leanserve.loader.gguf_quant import read_group_quantized
from leanserve.loader.gguf_tensors import open_gguf
from leanserve.quantization.weights import GroupQuantized, Int4Weight, Int8Weight, pack_group_quantized

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.loader.gguf_helpers import write_gguf_file


def _kernel_tolerance(g: GroupQuantized) -> torch.Tensor:
    """|packed - exact| bound from rounding scale and zero (= m + 8d) to bf16 (unit roundoff 2**-8 each)."""
    q = (g.codes.float() - g.offset if g.bits == 4 else g.codes.float()).view(*g.scale.shape, -1)
    zero = (g.bias + 8 * g.scale) if g.bias is not None else torch.zeros_like(g.scale)
    if g.bits == 4 and g.bias is not None:
        q = q - 8  # the kernel's (q - 8) * scale + zero
    return (2.0 ** -8 * (q.abs() * g.scale.abs()[..., None] + zero.abs()[..., None]) * 1.01 + 1e-12).flatten(1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_native_tensor_equals_gguf_dequantization(tmp_path: Path, qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((128, 96)) * 0.05 + rng.uniform(-0.02, 0.02, (128, 1))).astype(np.float32)
    reader = open_gguf(write_gguf_file(tmp_path / "t.gguf", "llama", [("w", gguf.quants.quantize(w, qtype), qtype)]))
    tensor = reader.tensors[0]
    expect = gguf.quants.dequantize(tensor.data, qtype).reshape(128, 96)
    g = read_group_quantized(tensor)
    assert g.shape == (128, 96) and g.bits == (8 if qtype == QT.Q8_0 else 4)
    assert np.array_equal(g.dequantize().numpy(), expect)  # bit-exact
    packed = pack_group_quantized(g)
    if qtype == QT.Q8_0:
        assert isinstance(packed, Int8Weight) and packed.group_size == 32
        assert np.array_equal(packed.dequantize().numpy(), expect)  # codes and fp32 scales unchanged
    else:
        assert isinstance(packed, Int4Weight) and packed.group_size == 32
        assert torch.equal(packed.codes(), g.codes)  # the packed codes are GGUF's, bit for bit
        err = (packed.dequantize() - torch.from_numpy(expect)).abs()
        assert torch.all(err <= _kernel_tolerance(g))


def test_default_model_native_matches_dequantized(loaded) -> None:
    """Every Q4_1 projection and the Q8_0 embedding of the default model, read natively (q/k rows un-permuted with
    their scales), dequantize exactly to the float weights the ordinary loader produces."""
    reader = open_gguf(default_model_path())
    config = gguf_model_config(reader)
    native = gguf_weights(reader, config, native=True)
    quantized = {k: v for k, v in native.items() if isinstance(v, GroupQuantized)}
    assert len(quantized) == 7 * config.num_layers + 1  # q, k, v, o, gate, up, down; the embedding
    assert quantized["model.embed_tokens.weight"].bits == 8  # Q8_0
    for name, g in quantized.items():
        assert torch.equal(g.dequantize(), loaded.weights[name]), name
    # the un-permutation moved whole rows: check one against the raw file
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    expect = unpermute_qk(gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(192, 576), config.num_kv_heads)
    assert np.array_equal(quantized["model.layers.0.self_attn.k_proj.weight"].dequantize().numpy(), expect)
