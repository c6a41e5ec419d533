"""leanserve: a lean LLM inference and serving engine (paged KV cache, continuous batching, OpenAI server).

The public names are imported lazily, so ``import leanserve.core`` does not pull in torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# fp32 matrix products on CPU run through NumPy's BLAS (see leanserve.quantization.weights). Its threads and
# torch's OpenMP threads take turns on the same cores, and with OpenMP's default spin-waiting each hand-over
# stalls; passive waiting must be chosen before torch loads OpenMP, so it is set here when leanserve is imported
# first (otherwise the torch kernels are used). Its effect is measured in the README ("Threads").
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# True when OpenMP's threads spin after each parallel op, on the cores the native decode kernels need
# (leanserve.worker.cpu_threads.warn_if_openmp_spins): as far as can be told here, when the policy is not PASSIVE
# (torch loaded first with it unset, empty or invalid, or ACTIVE chosen). A value put into os.environ after torch
# loaded OpenMP is not seen by OpenMP, yet looks the same here.
OPENMP_SPINS = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive"
# OpenBLAS's worker threads spin for 2**28 cycles after each call by default, holding a core that torch's OpenMP
# threads and leanserve's kernels (leanserve/kernels/spin_pool.h) need next; 2**16 cycles bridges the gaps
# between the GEMMs of one forward pass. Read when NumPy loads.
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "leanserve.entrypoints.llm",
    "SamplingParams": "leanserve.sampling_params",
    "StructuredOutputsParams": "leanserve.sampling_params",
    "RequestOutput": "leanserve.outputs",
    "CompletionOutput": "leanserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leanserve' has no attribute {name!r}")
