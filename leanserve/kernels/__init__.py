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
_DISABLE_ENV = "LEANSERVE_DISABLE_NATIVE_KERNELS"


def _build(name: str, source: str) -> ModuleType | None:
    """Compile (or load from torch's cache) the extension ``name`` from ``source`` in this folder; None when that
    fails or ``$LEANSERVE_DISABLE_NATIVE_KERNELS`` is set."""
    if os.environ.get(_DISABLE_ENV):
        return None
    try:
        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load

        return load(name=name, sources=[str(_DIR / source)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as e:  # compiler or ninja missing, headers mismatch: keep serving on the torch path
        logger.warning("native kernel %s unavailable (%s); using the torch path", name, e)
        return None


@functools.cache
def paged_attention_ext() -> ModuleType | None:
    """The compiled paged decode attention (``paged_decode_attention``; see paged_attention.cpp), or None (then
    callers use the torch path)."""
    return _build("leanserve_paged_attention", "paged_attention.cpp")


@functools.cache
def block_quant_ext() -> ModuleType | None:
    """The compiled GGUF block-quantized matmul (``block_quant_gemm``, ``block_dequantize``; see
    block_quant_gemm.cpp), or None (then GGUF 4/8-bit weights go to torch's packed int4/int8 kernels)."""
    return _build("leanserve_block_quant_gemm", "block_quant_gemm.cpp")


@functools.cache
def fused_ops_ext() -> ModuleType | None:
    """The compiled fused RMSNorm and RoPE (``add_rms_norm_``, ``rope_``; see fused_ops.cpp), or None (then the
    model runs the eager torch formulas)."""
    return _build("leanserve_fused_ops", "fused_ops.cpp")


def build_all() -> None:
    """Build every extension now (``make`` setup calls this once so that no server start pays for it)."""
    paged_attention_ext()
    block_quant_ext()
    fused_ops_ext()
