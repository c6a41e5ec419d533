"""Quantized weights and KV cache dtypes: names, validation and the modules that implement them.

* :mod:`leanserve.quantization.int4_pack` -- torch's CPU int4 packed layout: pack, and unpack (for checks).
* :mod:`leanserve.quantization.weights` -- weight-only int8 / int4 matrices (``Int8Weight``, ``Int4Weight``,
  ``BlockQuantWeight``) with their matmul, and ``GroupQuantized``, the exact unpacked form of GGUF Q4_0 / Q4_1 /
  Q8_0 tensors.
* :mod:`leanserve.quantization.kv_cache` -- the int8 KV cache (per token and head scales).
"""

from __future__ import annotations

from leanserve.errors import UnsupportedQuantizationError

# --quantization: "auto" keeps GGUF Q4_0/Q4_1/Q8_0 matrices (embedding and output included) in their file layout
# for leanserve's block kernel (or, without native kernels, the projections in torch's packed int4/int8 layouts)
# and everything else in float; "none" dequantizes everything to the model dtype; "int8" and "int4" quantize
# every projection from float weights at load.
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float16", "int8")  # "auto" = the model dtype
INT4_GROUP_SIZES = (32, 64, 128)


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
        UnsupportedQuantizationError: anything but "auto", "float16" or "int8" (fp8 is not offered: this CPU has no
            fp8 math).
    """
    if dtype not in KV_CACHE_DTYPES:
        raise UnsupportedQuantizationError(
            "kv_cache_dtype", f"unsupported kv_cache_dtype {dtype!r}; supported: {', '.join(KV_CACHE_DTYPES)}")
