"""The fused decode (leanserve/model/fused_decode.py, leanserve/kernels/decode_layers.cpp) against the per-op path:
the same kernels in the same order, so every decode step's logits must be bitwise equal, on each ISA path."""

from __future__ import annotations

import sys
import time

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM, SamplingParams
from leanserve.kernels import native_ops
from leanserve.loader import load_model
from leanserve.model import fused_decode as fused_module
from leanserve.model import llama as llama_module
from leanserve.worker import model_runner as runner_module

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")


@pytest.fixture(scope="module")
def loaded_auto():
    """The default model with its GGUF blocks kept (for --quantization auto)."""
    return load_model(None, quantization="auto")


@pytest.fixture(params=kernel_isa_paths())
def isa_llm(request, monkeypatch, loaded_auto):
    """An engine on the native Q4_1 weights whose kernels are one ISA path's."""
    for module in (llama_module, runner_module, sys.modules[__name__]):
        use_kernel_isa(request, monkeypatch, module)
    return LLM(loaded=loaded_auto, quantization="auto", kv_cache_memory=32 << 20)


@pytest.fixture(params=["auto", "float16"])
def kv_dtype_llm(request, isa_llm, loaded_auto):
    """isa_llm, or an engine of the same ISA path with a float16 KV cache (llama.cpp's default KV type)."""
    if request.param == "auto":
        return isa_llm
    llm = LLM(loaded=loaded_auto, quantization="auto", kv_cache_memory=32 << 20, kv_cache_dtype=request.param)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float16
    return llm


def _decode_logits(llm: LLM, prompts: list[str], tokens: int) -> tuple[list[torch.Tensor], list[str], int]:
    """Every step's logits, the texts, and how many steps took the fused path."""
    model = llm.engine.runner.model
    logits: list[torch.Tensor] = []
    fused_steps = [0]
    compute = model.compute_logits
    fd = model.fused_decode
    if fd is not None:
        forward = fd.forward

        def counted(*args):
            fused_steps[0] += 1
            return forward(*args)

        fd.forward = counted
    model.compute_logits = lambda h: logits.append(compute(h).clone()) or logits[-1]
    try:
        llm.engine.kv.pool.reset_prefix_cache()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        del model.compute_logits
        if fd is not None:
            del fd.forward
    return logits, [o.outputs[0].text for o in outs], fused_steps[0]


def test_fused_decode_logits_equal_per_op_path(kv_dtype_llm) -> None:
    llm = kv_dtype_llm
    model = llm.engine.runner.model
    assert model.fused_decode is not None, "Q4_1 lane weights on CPU should take the fused decode"
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    fused_logits, fused_texts, fused_steps = _decode_logits(llm, prompts, 8)
    assert fused_steps >= 7  # the decode-only steps (3 streams, then fewer as they finish together)
    fd, model.fused_decode = model.fused_decode, None
    try:
        ref_logits, ref_texts, _ = _decode_logits(llm, prompts, 8)
    finally:
        model.fused_decode = fd
    assert len(fused_logits) == len(ref_logits) == 8
    for a, b in zip(fused_logits, ref_logits, strict=True):
        assert torch.equal(a, b)
    assert fused_texts == ref_texts
    # a single stream (M = 1) too, which the kernels tile differently
    one, _, steps = _decode_logits(llm, prompts[:1], 4)
    assert steps == 3 and all(torch.equal(a, b[:1]) for a, b in zip(one, fused_logits[:4], strict=True))


def test_fused_decode_switch(monkeypatch, loaded_auto) -> None:
    monkeypatch.setenv(fused_module.FUSED_DECODE_ENV, "0")
    assert not fused_module.fused_decode_enabled()
    llm = LLM(loaded=loaded_auto, quantization="auto", kv_cache_memory=16 << 20)
    assert llm.engine.runner.model.fused_decode is None
    monkeypatch.delenv(fused_module.FUSED_DECODE_ENV)
    fp32 = LLM(loaded=loaded_auto, quantization="none", kv_cache_memory=16 << 20)
    assert fp32.engine.runner.model.fused_decode is None  # float weights: the per-op path


def test_fused_decode_phase_profile(loaded_auto) -> None:
    """With profiling on, the native call charges its wall time to its phases (every phase timed, their sum within
    the calls' own time), counts its calls, and computes the same logits; off, the totals stay as they were."""
    llm = LLM(loaded=loaded_auto, quantization="auto", kv_cache_memory=32 << 20)
    fd = llm.engine.runner.model.fused_decode
    assert fd is not None
    plain_logits, plain_texts, _ = _decode_logits(llm, ["Once upon a time"], 6)
    wall = [0.0]
    forward = fd.forward

    def timed(*args):
        t = time.perf_counter()
        out = forward(*args)
        wall[0] += time.perf_counter() - t
        return out

    fd.set_profiling(True)
    fd.forward = timed
    try:
        logits, texts, steps = _decode_logits(llm, ["Once upon a time"], 6)
    finally:
        fd.__dict__.pop("forward", None)  # _decode_logits drops the instance attribute already
        fd.set_profiling(False)
    prof = fd.profile()
    assert prof.pop("forwards") == steps == 5  # the 5 decode steps after the prefill
    assert set(prof) == {"add+RMSNorm", "qkv GEMM", "bias, RoPE, KV write, q copy", "attention", "o GEMM",
                         "gate_up GEMM", "SiLU(gate) * up", "down GEMM", "final add+RMSNorm"}
    assert all(v > 0 for v in prof.values())
    assert sum(prof.values()) <= wall[0]
    assert prof["gate_up GEMM"] > prof["SiLU(gate) * up"]  # 1.1 MB of weights against 3,072 floats
    assert texts == plain_texts and all(torch.equal(a, b) for a, b in zip(logits, plain_logits, strict=True))
    _decode_logits(llm, ["Once upon a time"], 3)
    assert fd.profile() == {**prof, "forwards": 5.0}  # off: nothing more is counted


def test_fused_decode_profiling_turned_on_from_another_thread(loaded_auto) -> None:
    """set_profiling(True) from another thread while steps run (the native call runs without the GIL): only the
    forwards that start after it are timed, so the phases never add up to more than the generation's wall time."""
    import threading

    llm = LLM(loaded=loaded_auto, quantization="auto", kv_cache_memory=32 << 20)
    fd = llm.engine.runner.model.fused_decode
    for delay in (0.02, 0.06):
        fd.set_profiling(False)
        toggler = threading.Timer(delay, fd.set_profiling, args=(True,))
        t = time.perf_counter()
        toggler.start()
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                     use_tqdm=False)
        wall = time.perf_counter() - t
        toggler.join()
        prof = fd.profile()
        assert 0 < prof.pop("forwards") <= 127
        assert sum(prof.values()) <= wall
    fd.set_profiling(False)
