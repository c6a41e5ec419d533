#!/usr/bin/env bash
# Builds an AVX2-only llama.cpp peer (llama-bench, llama-batched-bench, llama-server) for the forced-AVX2 rows of
# benchmarks.quant (LEANSERVE_KERNEL_ISA=avx2, issue #21): on an AVX-512 machine the stand-in for an AVX2-only one
# restricts both sides, leanserve's kernels and llama.cpp's. Not part of the product.
# Same source as the native peer (the llama.cpp vendored in the PyPI sdist of llama-cpp-python, unpacked by
# ../shared/tools/build-llama-cpp.sh into $LLAMA_CPP_HOME/src), built into a SEPARATE folder, build-avx2/ (the
# native build/ is never touched), with GGML_NATIVE=OFF and the x86 extensions named one by one: SSE4.2, AVX, AVX2,
# FMA, F16C, BMI2 on; AVX-512 (all of it), AVX-VNNI and AMX off; one CPU backend linked in (GGML_BACKEND_DL and
# GGML_CPU_ALL_VARIANTS off), so nothing can pick an AVX-512 variant at run time.
# Checks the result: the disassembly of libggml-cpu.so must hold ymm registers and not one zmm register.
# Usage: benchmarks/build_llama_cpp_avx2.sh [VERSION]   (default 0.3.36; 5-20 min on 2 cores, run it in the
# background). Re-running with the binaries present is instant. Prints the folder of the binaries on its last line.
set -euo pipefail
ver=${1:-0.3.36}
home=${LLAMA_CPP_HOME:-$HOME/.cache/leanserve-peers/llama-cpp-$ver}
src=$home/src/vendor/llama.cpp
build=$src/build-avx2
bin=$build/bin
stamp=$bin/.avx2-only
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ] && [ -f "$stamp" ]; then
  echo "AVX2-only llama.cpp $ver already built ($(cat "$stamp"))"
  echo "$bin"
  exit 0
fi
if [ ! -d "$src" ]; then  # unpack the same source the shared peer script uses
  mkdir -p "$home"
  ( cd "$home"
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$ver" -d dl >/dev/null
    mkdir -p src && tar xzf dl/llama_cpp_python-"$ver".tar.gz -C src --strip-components=1 )
fi
command -v cmake >/dev/null || { echo "cmake is needed (apt-get install cmake)" >&2; exit 1; }
command -v objdump >/dev/null || { echo "objdump is needed (apt-get install binutils)" >&2; exit 1; }
cd "$src"
rm -rf build-avx2
echo "configuring AVX2-only llama.cpp $ver in $build (log: $home/cmake-avx2.log)" >&2
cmake -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >"$home/cmake-avx2.log" 2>&1 \
  || { echo "cmake failed, see $home/cmake-avx2.log" >&2; exit 1; }
echo "building llama-bench llama-batched-bench llama-server (log: $home/build-avx2.log)" >&2
cmake --build build-avx2 -j"$(nproc)" --target llama-bench llama-batched-bench llama-server \
  >"$home/build-avx2.log" 2>&1 || { echo "build failed, see $home/build-avx2.log" >&2; exit 1; }
lib=$(ls "$bin"/libggml-cpu.so* 2>/dev/null | head -1 || true)
[ -n "$lib" ] || lib=$(find build-avx2 -name 'libggml-cpu.so*' -o -name 'libggml-cpu.a' | head -1)
[ -n "$lib" ] || { echo "no libggml-cpu library under $build" >&2; exit 1; }
zmm=$(objdump -d "$lib" | grep -c zmm || true)
ymm=$(objdump -d "$lib" | grep -c ymm || true)
if [ "$zmm" -ne 0 ] || [ "$ymm" -eq 0 ]; then
  echo "not an AVX2-only build: $lib has $zmm instructions on zmm registers and $ymm on ymm" >&2
  exit 1
fi
echo "verified AVX2-only: objdump -d $(basename "$lib"): $zmm zmm, $ymm ymm instructions" >&2
echo "zmm=0 ymm=$ymm $(basename "$lib")" >"$stamp"
echo "$bin"
