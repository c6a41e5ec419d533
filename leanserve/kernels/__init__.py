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

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_DISABLE_ENV = "LEANSERVE_DISABLE_NATIVE_KERNELS"


@functools.cache
def paged_attention_ext() -> ModuleType | None:
    """The compiled paged-attention extension, or None when it cannot be built or ``$LEANSERVE_DISABLE_NATIVE_KERNELS``
    is set (then callers use the torch path)."""
    if os.environ.get(_DISABLE_ENV):
        return None
    try:
        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load

        return load(name="leanserve_paged_attention", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as e:  # compiler or ninja missing, headers mismatch: keep serving on the torch path
        logger.warning("native paged attention unavailable (%s); using the torch path", e)
        return None
