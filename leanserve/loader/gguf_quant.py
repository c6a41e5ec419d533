"""GGUF Q4_0 / Q4_1 / Q8_0 tensors read straight into :class:`GroupQuantized` (codes + fp16 scales widened).

Block layouts (ggml-common.h; 32 weights per block, little-endian):

* Q4_0: ``d`` fp16, 16 bytes of nibbles; weight ``j`` is the low nibble of byte ``j`` for j < 16, else the high
  nibble of byte ``j - 16``; ``w = d * (q - 8)``.
* Q4_1: ``d`` fp16, ``m`` fp16, the same 16 bytes of nibbles; ``w = d * q + m``.
* Q8_0: ``d`` fp16, 32 int8 codes; ``w = d * q``.
"""

from __future__ import annotations

import warnings

from leanserve.errors import ModelLoadError
from leanserve.loader.gguf_tensors import tensor_shape
from leanserve.quantization.weights import GroupQuantized

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

NATIVE_TYPES: frozenset[QT] = frozenset({QT.Q4_0, QT.Q4_1, QT.Q8_0})


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[blocks, 16] uint8 (a strided view of the file's blocks) -> [blocks, 32] uint8 codes: low nibbles first, then
    high nibbles (written in place by torch's kernels: faster than numpy's temporaries at load)."""
    with warnings.catch_warnings():  # a read-only view of the file map: only read here
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        q = torch.from_numpy(qs)
    codes = torch.empty(q.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(q, 0x0F, out=codes[:, :16])
    torch.bitwise_right_shift(q, 4, out=codes[:, 16:])
    return codes


def read_group_quantized(tensor: gguf.ReaderTensor) -> GroupQuantized:
    """A Q4_0, Q4_1 or Q8_0 matrix as :class:`GroupQuantized` [out, in], with no arithmetic on the values.

    Raises:
        ModelLoadError: the type is not one of these, the tensor is not 2-D, or its data size is inconsistent.
    """
    qtype = tensor.tensor_type
    if qtype not in NATIVE_TYPES:
        raise ModelLoadError(f"tensor {tensor.name!r} of type {qtype.name} has no native quantized layout")
    shape = tensor_shape(tensor)
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {tensor.name!r}: native quantized tensors must be matrices, got {shape}")
    out, k = shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    if k % block or raw.size != out * (k // block) * type_size:
        raise ModelLoadError(f"tensor {tensor.name!r}: {raw.size} bytes do not hold {shape} {qtype.name}")
    blocks = raw.reshape(out * (k // block), type_size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(out, k // block)
    bias = None
    if qtype == QT.Q8_0:
        codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
        bits, offset = 8, 0
    elif qtype == QT.Q4_0:
        codes = _nibbles(blocks[:, 2:])
        bits, offset = 4, 8
    else:  # Q4_1
        bias = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(out, k // block))
        codes = _nibbles(blocks[:, 4:])
        bits, offset = 4, 0
    return GroupQuantized(codes.reshape(out, k), torch.from_numpy(d), bias, offset, bits, block)
