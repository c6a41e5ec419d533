"""glibc malloc settings for the engine's per-step temporaries, applied once per process (``mallopt`` via ctypes).

Each forward pass allocates activations and kernel outputs of 0.1-30 MB (a 2,048-token prefill: [T, 3072] float32
gate/up products, bf16 copies of the activations, attention outputs). glibc serves requests above its mmap
threshold (128 KiB at start, raised dynamically only up to the largest block freed so far) with a fresh ``mmap``
and returns them with ``munmap`` on free, and it trims the heap's free top back to the kernel once it exceeds the
trim threshold: either way the next step's temporaries are new pages, each first touch a minor page fault the
kernel zero-fills. :func:`tune_malloc` keeps them in the heap instead (``M_MMAP_THRESHOLD`` 32 MiB, glibc's
ceiling; ``M_TRIM_THRESHOLD`` 1 GiB; ``M_TOP_PAD`` 64 MiB of slack per heap extension), so a step reuses the pages
the previous one freed. The cost: freed heap memory stays resident up to the trim threshold (the process keeps its
peak of temporaries, not more). The KV pools do not depend on this (their own mappings,
:mod:`leanserve.quantization.anon_memory`). vLLM's CPU backend asks users to preload tcmalloc for the same reason.

Not applied when ``$LEANSERVE_MALLOC_TUNING`` is ``0``, when any of glibc's own ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_TOP_PAD_`` is set (the user's settings win), or when the C library is not
glibc (musl, macOS: a no-op). Measured effect: README.md ("CPU kernels", "Memory of the hot paths").
"""

from __future__ import annotations

import ctypes
import os
import threading

ENV = "LEANSERVE_MALLOC_TUNING"
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# glibc's mallopt parameters (malloc.h) and leanserve's values, in bytes
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def tune_malloc() -> bool:
    """Applies :data:`SETTINGS` with glibc's ``mallopt`` once per process (later calls return the first result).

    Returns:
        True when the settings are in effect, False when skipped (opted out by ``$LEANSERVE_MALLOC_TUNING=0``,
        glibc's ``MALLOC_*_`` variables set, not glibc, or ``mallopt`` refused a value). Never raises.
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip() == "0" or any(name in os.environ for name in GLIBC_ENV):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and macOS have no such symbol  # noqa: B018
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)  # mallopt returns 1 on success
