"""The native kernels build wherever a C++ compiler is present, so a compile error cannot hide behind the torch
fallbacks (which keep leanserve serving, slower, when there is no compiler)."""

from __future__ import annotations

import shutil

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops

import pytest


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_native_kernels_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEANSERVE_DISABLE_NATIVE_KERNELS", raising=False)
    native_ops.cache_clear()
    ops = native_ops()
    assert ops is not None, "the native kernels failed to build: see the warning logged above"
    for name in ("paged_decode_attention", "block_quant_gemm", "block_dequantize", "add_rms_norm_", "rope_"):
        assert callable(getattr(ops, name)), name
