"""Which llama.cpp build benchmarks.quant runs (benchmarks/llama_cpp_build.py) and the AVX2 build script's fast
path, on fake bin folders (no llama.cpp build needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.llama_cpp_build import AVX2_STAMP, resolve_llama_cpp_bin
from benchmarks.quant import peer_builds

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks/build_llama_cpp_avx2.sh"


def bin_folder(path: Path, avx2: bool = False, tools=("llama-bench", "llama-batched-bench", "llama-server")) -> Path:
    """A folder of executable stand-ins for llama.cpp's tools, stamped AVX2-only when ``avx2``."""
    path.mkdir(parents=True)
    for name in tools:
        (path / name).write_text("#!/bin/sh\n")
        (path / name).chmod(0o755)
    if avx2:
        (path / AVX2_STAMP).write_text("zmm=0 ymm=1 libggml-cpu.so\n")
    return path


@pytest.fixture
def native(tmp_path, monkeypatch) -> Path:
    """A native build, found through $LLAMA_SERVER as benchmarks.common.find_llama_server finds it."""
    folder = bin_folder(tmp_path / "build/bin")
    monkeypatch.setenv("LLAMA_SERVER", str(folder / "llama-server"))
    return folder


def test_avx2_env_and_build_present_picks_the_avx2_build(tmp_path, native):
    avx2 = bin_folder(tmp_path / "build-avx2/bin", avx2=True)
    build = resolve_llama_cpp_bin(None, "avx2", avx2_bin=avx2)
    assert (build.bin, build.isa) == (str(avx2), "avx2")
    assert build.record() == {"bin": str(avx2), "isa": "avx2"}
    assert resolve_llama_cpp_bin(None, " AVX2 ", avx2_bin=avx2).bin == str(avx2)  # as kernel_isa() reads it


def test_without_avx2_env_the_native_build(tmp_path, native):
    avx2 = bin_folder(tmp_path / "build-avx2/bin", avx2=True)
    for isa in ("native", ""):
        build = resolve_llama_cpp_bin(None, isa, avx2_bin=avx2)
        assert (build.bin, build.isa) == (str(native), "native")


def test_avx2_env_without_a_verified_avx2_build_falls_back_to_native(tmp_path, native):
    missing = tmp_path / "absent/bin"
    assert resolve_llama_cpp_bin(None, "avx2", avx2_bin=missing).bin == str(native)
    unverified = bin_folder(tmp_path / "build-avx2/bin", avx2=False)  # built, but never checked for zmm
    build = resolve_llama_cpp_bin(None, "avx2", avx2_bin=unverified)
    assert (build.bin, build.isa) == (str(native), "native")


def test_explicit_folder_wins(tmp_path, native):
    avx2 = bin_folder(tmp_path / "build-avx2/bin", avx2=True)
    other = bin_folder(tmp_path / "other/bin")
    assert resolve_llama_cpp_bin(str(other), "avx2", avx2_bin=avx2).record() == {"bin": str(other),
                                                                                "isa": "native"}
    assert resolve_llama_cpp_bin(str(avx2), "native", avx2_bin=tmp_path / "x").isa == "avx2"  # its stamp


def test_explicit_folder_without_llama_bench_is_an_error(tmp_path, native):
    empty = bin_folder(tmp_path / "empty", tools=("llama-server",))
    with pytest.raises(FileNotFoundError, match="no executable llama-bench"):
        resolve_llama_cpp_bin(str(empty))
    with pytest.raises(SystemExit, match="no executable llama-bench"):
        peer_builds([str(native), str(empty)])


def test_no_build_at_all_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nothing/llama-server"))
    monkeypatch.setenv("HOME", str(tmp_path))  # where find_llama_server looks for the native build
    assert resolve_llama_cpp_bin(None, "avx2", avx2_bin=tmp_path / "absent") is None


def test_peer_builds_default_under_forced_avx2_says_which(tmp_path, native, monkeypatch, capsys):
    monkeypatch.setenv("LEANSERVE_KERNEL_ISA", "avx2")
    monkeypatch.setattr("benchmarks.llama_cpp_build.AVX2_BIN", tmp_path / "absent")
    [build] = peer_builds([])
    assert build.isa == "native"
    out = capsys.readouterr().out
    assert f"llama.cpp peer: {native} (native build)" in out and "make llama-cpp-avx2" in out
    two = peer_builds([str(native), str(bin_folder(tmp_path / "avx2", avx2=True))])
    assert [b.isa for b in two] == ["native", "avx2"]


def test_build_script_is_instant_when_built(tmp_path):
    home = tmp_path / "llama-cpp"
    folder = bin_folder(home / "src/vendor/llama.cpp/build-avx2/bin", avx2=True)
    out = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "LLAMA_CPP_HOME": str(home)},
                         capture_output=True, text=True, timeout=30, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == str(folder) and "already built (zmm=0" in lines[0]
    assert sorted(p.name for p in folder.parent.parent.iterdir()) == ["build-avx2"]  # nothing else made
