"""Which llama.cpp build a benchmark runs as its peer: the native one (``GGML_NATIVE=ON``, AVX-512 where the CPU
has it) or the AVX2-only one of ``benchmarks/build_llama_cpp_avx2.sh`` (``make llama-cpp-avx2``), the stand-in's
peer when ``LEANSERVE_KERNEL_ISA=avx2`` restricts leanserve's kernels to AVX2 on an AVX-512 machine (issue #21)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import find_llama_server

LLAMA_CPP_SRC = Path.home() / ".cache/leanserve-peers/llama-cpp-0.3.36/src/vendor/llama.cpp"
AVX2_BIN = LLAMA_CPP_SRC / "build-avx2/bin"
# written by build_llama_cpp_avx2.sh once objdump found no zmm register in libggml-cpu.so
AVX2_STAMP = ".avx2-only"


@dataclass(frozen=True)
class LlamaCppBuild:
    """A llama.cpp bin folder (holding llama-bench and llama-batched-bench) and its instruction set: ``"avx2"`` for
    a folder the AVX2-only build script verified (its stamp file), else ``"native"``."""

    bin: str
    isa: str

    def record(self) -> dict[str, str]:
        """The JSON record of the build: ``{"bin": folder, "isa": "avx2" | "native"}``."""
        return {"bin": self.bin, "isa": self.isa}


def _has_bench(folder: Path) -> bool:
    exe = folder / "llama-bench"
    return exe.is_file() and os.access(exe, os.X_OK)


def build_of(folder: str | Path) -> LlamaCppBuild:
    """The build in ``folder``. Raises FileNotFoundError when it holds no executable llama-bench."""
    folder = Path(folder).expanduser()
    if not _has_bench(folder):
        raise FileNotFoundError(f"no executable llama-bench in {folder} (--llama-cpp-bin is the folder of llama.cpp's "
                                "llama-bench and llama-batched-bench)")
    return LlamaCppBuild(str(folder), "avx2" if (folder / AVX2_STAMP).is_file() else "native")


def resolve_llama_cpp_bin(explicit: str | None = None, kernel_isa: str | None = None,
                          avx2_bin: Path | None = None) -> LlamaCppBuild | None:
    """The peer build to run.

    ``explicit`` (``--llama-cpp-bin``) wins; a folder without llama-bench raises FileNotFoundError (a wrong path is
    an error, not a reason to run another build). Otherwise, when ``kernel_isa`` (default:
    ``$LEANSERVE_KERNEL_ISA``) is ``avx2`` and ``avx2_bin`` (default: ``AVX2_BIN``) holds a verified AVX2-only
    build, that one; otherwise the folder of the llama-server that :func:`benchmarks.common.find_llama_server`
    finds (``$LLAMA_SERVER``, else the native build), or None when there is none.
    """
    if explicit:
        return build_of(explicit)
    avx2_bin = AVX2_BIN if avx2_bin is None else avx2_bin
    if kernel_isa is None:
        kernel_isa = os.environ.get("LEANSERVE_KERNEL_ISA", "")
    if kernel_isa.strip().lower() == "avx2" and _has_bench(avx2_bin) and (avx2_bin / AVX2_STAMP).is_file():
        return LlamaCppBuild(str(avx2_bin), "avx2")
    server = find_llama_server(None)
    if server is None or not _has_bench(Path(server).parent):
        return None
    return build_of(Path(server).parent)
