"""Fixtures of the benchmark tests: the default model's tokenizer and the offline corpus, loaded once."""

from __future__ import annotations

import leanserve  # noqa: F401  (first, so that it picks OpenMP's wait policy before torch loads)

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, read from its GGUF file without the weights."""
    from leanserve.bench.command import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def corpus(tokenizer):
    """The standard-library corpus under the default model's tokenizer."""
    from leanserve.bench.corpus import Corpus

    return Corpus.load(tokenizer)
