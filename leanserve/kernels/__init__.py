"""Native CPU kernels, compiled on first use with the system C++ compiler (``torch.utils.cpp_extension``).

Each kernel has a pure-torch fallback: when compiling fails (no compiler, no ninja), leanserve logs a warning and
keeps serving on the fallback. Compiled objects are cached by torch under ``~/.cache/torch_extensions`` (or
``$TORCH_EXTENSIONS_DIR``), so only the first process pays the ~1 minute build.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "block_quant_gemm.cpp", "fused_ops.cpp")
_DISABLE_ENV = "LEANSERVE_DISABLE_NATIVE_KERNELS"


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels (one extension, so they share one thread pool, see spin_pool.h), or None when they
    cannot be built or ``$LEANSERVE_DISABLE_NATIVE_KERNELS`` is set (then callers use the torch paths):

    * ``paged_decode_attention`` (paged_attention.cpp): decode attention read in place from the paged KV cache;
    * ``block_quant_gemm``, ``block_dequantize`` (block_quant_gemm.cpp): GGUF Q4_0/Q4_1/Q8_0 weights in their
      file layout;
    * ``add_rms_norm_``, ``rope_`` (fused_ops.cpp): the residual add + RMSNorm and RoPE in one pass per row.
    """
    if os.environ.get(_DISABLE_ENV):
        return None
    try:
        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load

        return load(name="leanserve_kernels", sources=[str(_DIR / s) for s in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as e:  # compiler or ninja missing, headers mismatch: keep serving on the torch path
        logger.warning("native kernels unavailable (%s); using the torch paths", e)
        return None
