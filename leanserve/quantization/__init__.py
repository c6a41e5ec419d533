"""Quantized weights and KV cache dtypes: names, validation and the modules that implement them.

* :mod:`leanserve.quantization.int4_pack` -- torch's CPU int4 packed layout: pack, and unpack (for checks).
* :mod:`leanserve.quantization.weights` -- the model's weight matrices, each with the one ``matmul`` that picks
  its kernel (the ``LinearWeight`` protocol): ``FloatWeight`` (float32 / bfloat16), the weight-only int8 / int4
  ``Int8Weight`` and ``Int4Weight``, GGUF blocks in ``BlockQuantWeight``; and ``GroupQuantized``, the exact unpacked
  form of GGUF Q4_0 / Q4_1 / Q8_0 tensors.
* :mod:`leanserve.quantization.kv_cache` -- the int8 KV cache (per token and head scales).
"""

from __future__ import annotations

# The method names, KV cache dtypes and their checks live with the engine's options (leanserve.config), which
# validates them on construction; re-exported here for the modules that implement them.
from leanserve.config import (
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    check_kv_cache_dtype,
    check_quantization,
)

__all__ = ["INT4_GROUP_SIZES", "KV_CACHE_DTYPES", "QUANTIZATION_METHODS", "check_kv_cache_dtype",
           "check_quantization"]
