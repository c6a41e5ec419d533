"""Native CPU kernels, compiled on first use with the system C++ compiler (``torch.utils.cpp_extension``).

Each kernel has a pure-torch fallback: when compiling fails (no compiler, no ninja), leanserve logs a warning and
keeps serving on the fallback. Compiled objects are cached by torch under ``~/.cache/torch_extensions`` (or
``$TORCH_EXTENSIONS_DIR``), so only the first process pays the ~1 minute build.

The cache entry is keyed by what the object code depends on (:func:`build_key`): the sources' bytes, the compiler
flags, the torch version and the CPU (``-march=native`` compiles for the build host). The sources are copied into
the entry before building, so two checkouts or venvs of the same sources share one build instead of rebuilding
each other's (the build files name absolute source paths), and a build made on one kind of CPU is never loaded on
another. A finished build is also copied to ``<entry>/<name>.built.so`` and later imported from there without
torch's up-to-date check, whose build file names the venv's include paths (two venvs would otherwise rebuild the
entry back and forth).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "block_quant_gemm.cpp", "fused_ops.cpp", "kquant_gemm.cpp",
            "f32_gemm.cpp", "decode_layers.cpp", "lane_dequant.cpp", "prefill_attention.cpp", "kv_write.cpp",
            "amx_gemm.cpp", "lane_q8_gemm.cpp", "row_ops.cpp")
_DISABLE_ENV = "LEANSERVE_DISABLE_NATIVE_KERNELS"
_HEADERS = ("spin_pool.h", "simd_exp.h", "kv_write.h", "amx_gemm.h", "amx_tiles.h", "out_rows.h", "block_amax.h")
_CFLAGS = ("-O3", "-march=native", "-ffast-math")
ISA_ENV = "LEANSERVE_KERNEL_ISA"
# Instruction-set paths: "native" compiles for this CPU (AVX-512 and VNNI where present); "avx2" turns AVX-512 and
# AVX-VNNI off, which gives an AVX2-only machine's code (a stand-in, tested on AVX-512 machines).
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni")}


def _cpu_identity() -> str:
    """The CPU model and its feature flags (Linux ``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        model = next((ln for ln in lines if ln.startswith("model name")), "")
        flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
        return model.strip() + "|" + flags.strip()
    except OSError:
        return platform.machine() + "|" + platform.processor()


# The SIMD features the kernels (or torch's) can use, as /proc/cpuinfo names them.
SIMD_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
                 "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    """``{"model": str, "simd": [the SIMD_FEATURES present], "cpu_count": int, "l3_cache_bytes": int | None}`` of
    this machine, for benchmark results (which kind of machine a number was measured on)."""
    model, _, flags = _cpu_identity().partition("|")
    present = set(flags.partition(":")[2].split())
    return {"model": model.partition(":")[2].strip() or platform.processor(),
            "simd": [f for f in SIMD_FEATURES if f in present], "cpu_count": os.cpu_count(),
            "l3_cache_bytes": l3_cache_bytes()}


@functools.cache
def l3_cache_bytes() -> int | None:
    """The size of the last-level (L3) cache of CPU 0 in bytes, from Linux sysfs, or None when unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(base.glob("index*")):
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip().upper()  # e.g. "32768K"
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
                return int(size.rstrip("KMG")) * scale
    except (OSError, ValueError):
        return None
    return None


def use_streaming_prefetch(weight_bytes: int, l3_bytes: int | None = None) -> str:
    """Picks the lane kernels' software prefetch hint for a model of ``weight_bytes`` (bytes read per decode
    step) and sets it process-wide: "nta" (non-temporal) when the weights exceed the L3 cache (``l3_bytes``,
    default :func:`l3_cache_bytes`), so that streaming them each step does not evict what else could stay
    cached (the KV cache, the rest of the step's working set); else "t0". Sticky: once a model in the process
    streams, later (smaller) models keep "nta". Returns the hint in force; "t0" without native kernels."""
    ops = native_ops()
    if ops is None:
        return "t0"
    l3 = l3_cache_bytes() if l3_bytes is None else l3_bytes
    if l3 is not None and weight_bytes > l3:
        ops.set_lane_prefetch_hint("nta")
    return ops.lane_prefetch_hint()


def kernel_isa() -> str:
    """The instruction-set path asked for by ``$LEANSERVE_KERNEL_ISA`` ("native", the default, or "avx2").

    Raises:
        EnvironmentSettingError: another value (a ValueError)."""
    from leanserve.errors import EnvironmentSettingError

    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise EnvironmentSettingError(ISA_ENV, f"${ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, not {isa!r}")
    return isa


def cflags(isa: str = "native") -> tuple[str, ...]:
    """The compiler flags of an instruction-set path (see ``ISA_FLAGS``)."""
    return _CFLAGS + ISA_FLAGS[isa]


def build_key(isa: str = "native") -> str:
    """12 hex digits of a SHA-256 over the kernel sources and headers, the flags, torch's version and the CPU."""
    import torch

    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode() + b"\0" + (_DIR / name).read_bytes() + b"\0")
    h.update(" ".join(cflags(isa)).encode() + b"\0" + torch.__version__.encode() + b"\0" + _cpu_identity().encode())
    return h.hexdigest()[:12]


def _staged_sources(key: str) -> list[str]:
    """Copies the sources into ``<torch extensions dir>/leanserve_src_<key>/`` (once) and returns their paths."""
    from torch.utils.cpp_extension import _get_build_directory

    dest = Path(_get_build_directory(f"leanserve_src_{key}", verbose=False))
    for name in _SOURCES + _HEADERS:
        target = dest / name
        if not target.exists() or target.read_bytes() != (_DIR / name).read_bytes():
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            shutil.copyfile(_DIR / name, tmp)
            os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
    return [str(dest / s) for s in _SOURCES]


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels (one extension, so they share one thread pool, see spin_pool.h), or None when they
    cannot be built or ``$LEANSERVE_DISABLE_NATIVE_KERNELS`` is set (then callers use the torch paths), for the
    instruction-set path of ``$LEANSERVE_KERNEL_ISA`` (:func:`kernel_isa`; a bad value raises its
    EnvironmentSettingError):

    * ``paged_decode_attention`` (paged_attention.cpp): decode attention read in place from the paged KV cache;
    * ``paged_prefill_attention``, ``prefill_attention_bf16_simd`` (prefill_attention.cpp): a prefill chunk's
      causal attention read in place from the paged KV cache (flash attention, fp32 or bf16 dot products);
    * ``block_quant_gemm``, ``block_dequantize`` (block_quant_gemm.cpp): GGUF Q4_0/Q4_1/Q8_0 weights in their
      file layout;
    * ``kquant_gemm``, ``kquant_dequantize`` (kquant_gemm.cpp): GGUF Q4_K / Q6_K weights in their file bytes;
    * ``f32_small_gemm`` (f32_gemm.cpp): float32 products of 1-8 rows, each weight row read once for all rows;
    * ``add_rms_norm_``, ``rope_`` (fused_ops.cpp): the residual add + RMSNorm and RoPE in one pass per row;
    * ``lane_dequant_bf16``, ``bf16_gemm``, ``bf16_gemm_simd`` (lane_dequant.cpp): prefill products of lane-layout
      weights through a bf16 scratch copy and an AVX512_BF16 GEMM with fp32 output; ``amx_bf16_status``
      (amx_gemm.cpp): whether this process may run ``bf16_gemm``'s AMX engine (CPUID, XCR0, the arch_prctl tile
      permission), which runs the same product on AMX tiles;
    * ``lane_q8_gemm``, ``lane_q8_gemm_isa`` (lane_q8_gemm.cpp): prefill products of 4-bit lane-layout weights with
      int8 activations (vpmaddubsw, or vpdpbusd where the build has VNNI): the AVX2 machines' prefill path;
    * ``write_kv_`` (kv_write.cpp, kv_write.h): a layer's new K/V rows into its float32 or float16 paged cache
      through the slot mapping (the fused decode's KV write too);
    * ``argmax_rows``, ``lane_gather_rows`` (row_ops.cpp): the greedy sampler's argmax in one pass; rows of a
      lane-layout weight in file layout (the embedding lookup);
    * ``DecodeLayers`` (decode_layers.cpp): a Llama model's decoder layers for a decode-only step in one call,
      bitwise equal to the per-op path (leanserve/model/fused_decode.py builds it).
    """
    if os.environ.get(_DISABLE_ENV):
        return None
    isa = kernel_isa()  # a bad $LEANSERVE_KERNEL_ISA is the user's error, not a reason to run the torch paths
    try:
        return build_native_ops(isa)
    except Exception as e:  # compiler or ninja missing, headers mismatch: keep serving on the torch path
        logger.warning("native kernels unavailable (%s); using the torch paths", e)
        return None


def build_native_ops(isa: str) -> ModuleType:
    """Builds (once per :func:`build_key`) and loads the extension of one instruction-set path.

    Raises:
        ValueError: an unknown ``isa``; the compiler's or torch's exception when the build fails."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown kernel ISA {isa!r} (one of {', '.join(ISA_FLAGS)})")
    if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    key = build_key(isa)
    name = f"leanserve_kernels_{key}"
    if name in sys.modules:
        return sys.modules[name]
    built = _built_copy(name)
    if built.exists():  # built before, by any checkout or venv: the key says it is these sources for this CPU
        return _import_extension(name, built)
    from torch.utils.cpp_extension import load

    module = load(name=name, sources=_staged_sources(key), extra_cflags=list(cflags(isa)), verbose=False)
    sys.modules[name] = module  # a later call in this process returns it (not a second copy of the library)
    tmp = built.with_name(f"{built.name}.{os.getpid()}.tmp")
    shutil.copyfile(module.__file__, tmp)
    os.replace(tmp, built)  # atomic: a reader sees a whole copy or none
    return module


def _built_copy(name: str) -> Path:
    """Where a finished build of extension ``name`` is kept: torch's build directory holds the build itself, which
    torch's ``load`` checks against its build file (whose compiler commands name the venv's include paths, so a
    checkout with another venv would rebuild it, and the first checkout then rebuild it back); this copy is made
    only after a build succeeded and is imported as it is."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / f"{name}.built.so"


def _import_extension(name: str, path: Path) -> ModuleType:
    """Imports the compiled extension module ``name`` from ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
