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


def test_build_key_follows_sources_flags_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache entry changes with what the object code depends on, and with nothing else (not the checkout)."""
    from leanserve import kernels

    key = kernels.build_key()
    assert len(key) == 12 and key == kernels.build_key()
    monkeypatch.setattr(kernels, "_cpu_identity", lambda: "other cpu|flags avx2")
    other_cpu = kernels.build_key()
    monkeypatch.setattr(kernels, "_CFLAGS", ("-O2",))
    other_flags = kernels.build_key()
    assert len({key, other_cpu, other_flags}) == 3


def test_sources_are_staged_by_content(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkouts build from the same staged copy, so neither rebuilds the other's kernels."""
    from leanserve import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    paths = kernels._staged_sources("test0key")
    assert [p.rsplit("/", 1)[-1] for p in paths] == list(kernels._SOURCES)
    for name in kernels._SOURCES + kernels._HEADERS:
        assert (tmp_path / "leanserve_src_test0key" / name).read_bytes() == (kernels._DIR / name).read_bytes()
    assert kernels._staged_sources("test0key") == paths


def test_cpu_info_names_this_machine():
    from leanserve import kernels

    info = kernels.cpu_info()
    flags = kernels._cpu_identity().partition("|")[2].split()
    assert info["cpu_count"] >= 1 and info["model"]
    assert info["simd"] == [f for f in kernels.SIMD_FEATURES if f in flags]


def test_kernel_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from leanserve import kernels

    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.kernel_isa() == "native"
    monkeypatch.setenv(kernels.ISA_ENV, "AVX2")
    assert kernels.kernel_isa() == "avx2" and kernels.build_key("avx2") != kernels.build_key("native")
    assert "-mno-avx512f" in kernels.cflags("avx2")
    monkeypatch.setenv(kernels.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="LEANSERVE_KERNEL_ISA must be one of native, avx2"):
        kernels.kernel_isa()


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_a_finished_build_is_imported_without_torchs_build_check() -> None:
    """Once built, the kernels load from the build's copy: a process whose torch ``load`` would fail (as a checkout
    with another venv would make it rebuild) still gets them, the same build."""
    import subprocess
    import sys

    from leanserve import kernels

    assert native_ops() is not None
    built = kernels._built_copy(f"leanserve_kernels_{kernels.build_key(kernels.kernel_isa())}")
    assert built.exists()
    code = ("import torch.utils.cpp_extension as c\n"
            "def refuse(*a, **k): raise RuntimeError('load called')\n"
            "c.load = refuse\n"
            "from leanserve.kernels import build_native_ops, kernel_isa\n"
            "m = build_native_ops(kernel_isa())\n"
            "print(m.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(built)
