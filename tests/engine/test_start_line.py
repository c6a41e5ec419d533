"""The server's start line (``LLMEngine.describe``) names a prefill GEMM only where ``--prefill-gemm`` chooses one:
lane-layout GGUF weights on the native kernels. Torch-quantized int8 weights and the torch paths
(``--no-native-kernels``) run their own products at every row count."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM
from leanserve.kernels import native_ops
from leanserve.loader import load_model

import pytest


@pytest.mark.parametrize(("quantization", "native"), [("int8", True), ("auto", False), ("auto", True)])
def test_start_line_names_a_prefill_gemm_only_where_one_runs(quantization: str, native: bool) -> None:
    llm = LLM(loaded=load_model(None, quantization=quantization), quantization=quantization,
              kv_cache_memory=16 << 20, use_native_kernels=native)
    line = llm.engine.describe()
    assert line.startswith(f"weights {quantization}, dtype float32"), line
    lane = native and quantization == "auto" and native_ops() is not None
    assert ("prefill GEMM" in line) == lane, line
    if lane:
        assert f", prefill GEMM {llm.engine.prefill_gemm}" in line
    out = llm.generate(["The capital of France is"], use_tqdm=False)[0].outputs[0]
    assert out.token_ids  # it serves in each configuration
