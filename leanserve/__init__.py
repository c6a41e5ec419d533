"""leanserve: a lean LLM inference and serving engine (paged KV cache, continuous batching, OpenAI server).

The public names are imported lazily, so ``import leanserve.core`` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "leanserve.entrypoints.llm",
    "SamplingParams": "leanserve.sampling_params",
    "RequestOutput": "leanserve.outputs",
    "CompletionOutput": "leanserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leanserve' has no attribute {name!r}")
