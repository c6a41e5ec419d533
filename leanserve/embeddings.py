"""Sentence embeddings for the layers that compare texts: the semantic answer cache (``leanserve.context``) and
the learned model router (``leanserve.routing``).

WordLlama (``wordllama`` on PyPI, numpy only): the 256-dimension ``l2_supercat`` weights and its tokenizer ship
inside the package and are loaded with downloads disabled, so nothing is fetched at run time. Vectors are
L2-normalized, so a dot product is the cosine similarity.
"""

from __future__ import annotations

import threading

from leanserve.errors import ModelLoadError

import numpy as np


class WordLlamaEmbedder:
    """Sentence embeddings from the ``wordllama`` package's bundled weights (no download). Thread-safe.

    Raises:
        ModelLoadError: the package is not installed or its bundled files are missing.
    """

    def __init__(self) -> None:
        try:
            import pathlib

            import wordllama
            from wordllama import WordLlama
        except ImportError as exc:  # pragma: no cover - a dependency of the project
            raise ModelLoadError(f"sentence embeddings need the wordllama package: {exc}") from None
        package = pathlib.Path(wordllama.__file__).parent  # its weights/ and tokenizers/ folders: no download
        try:
            self._model = WordLlama.load(cache_dir=package, disable_download=True)
        except (FileNotFoundError, ValueError) as exc:
            raise ModelLoadError(f"cannot load wordllama's bundled model: {exc}") from None
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 256) float32, each row of L2 norm 1 (0 for an empty text)."""
        with self._lock:
            v = np.asarray(self._model.embed(texts), dtype=np.float32)
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        return v / np.where(norms == 0, 1.0, norms)
