// The AMX engine of bf16_gemm (lane_dequant.cpp): the same product, y = x @ w.T with bf16 operands in the
// pair-packed layout and fp32 accumulation and output, on Intel AMX tiles (TDPBF16PS), and the run-time probe
// that says whether this process may use them. Defined in amx_gemm.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace leanserve {

// Why this process can or cannot run AMX bf16 tiles, probed once: "ready"; "build" (this build has no AMX engine:
// not x86-64 Linux with GCC/Clang, or the forced AVX2 path); "cpu" (CPUID lacks AMX-TILE or AMX-BF16); "os" (XCR0
// lacks XTILECFG / XTILEDATA: the kernel does not manage tile state); "permission" (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA was refused). Only "ready" makes a tile instruction safe: without the
// permission the first one raises SIGILL. Requesting the permission is the probe's one side effect (process-wide,
// as the kernel grants it).
std::string amx_bf16_status();

// Rows of x the AMX engine reads per register tile group: xh (and xl) must hold round_up(M, amx_row_block(x3))
// rows, the rows past M zero (their products are computed and dropped).
int64_t amx_row_block(bool x3);

// y [M, N] fp32 (rows at stride N) = xh @ wh.T (bf16x3 with xl and wl non-null: xh wh + xh wl + xl wh), w pair-packed
// (see lane_dequant.cpp), K a multiple of 32, N of 64. emulate: run the same tile program on a scalar model of the
// tiles (Intel SDM pseudocode of TDPBF16PS: per output, the pairs of k in order, the even element's product
// added before the odd one's, bf16 inputs with zero exponent read as zero, subnormal sums flushed to zero), for
// tests on machines without AMX. Without emulate the caller must have seen amx_bf16_status() == "ready".
void amx_bf16_gemm(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const uint16_t* wh,
                   const uint16_t* wl, int64_t N, float* y, bool emulate);

}  // namespace leanserve
