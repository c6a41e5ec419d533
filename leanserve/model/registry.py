"""Which decoder class runs a :class:`leanserve.config.ModelConfig`: Gemma 3 or the Llama family."""

from __future__ import annotations

from leanserve.config import ModelConfig
from leanserve.model.gemma3 import Gemma3Model
from leanserve.model.llama import LlamaModel


def model_class(config: ModelConfig) -> type[LlamaModel] | type[Gemma3Model]:
    """:class:`Gemma3Model` for ``architecture == "gemma3"``, else :class:`LlamaModel` (llama, mistral, qwen2).
    Both take the same constructor arguments and offer the same ``forward`` / ``compute_logits``."""
    return Gemma3Model if config.architecture == "gemma3" else LlamaModel
