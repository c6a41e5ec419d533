// Intel AMX tiles for the kernels that use them (amx_gemm.cpp, prefill_attention.cpp): the tile configuration,
// the hardware tiles (TDPBF16PS and its loads and stores as inline assembly, which GNU as knows whatever -march
// says) and a scalar model of the tiles that runs the same tile program on memory, for tests on machines without
// AMX. Hardware tiles run only after amx_bf16_status() == "ready" (amx_gemm.h): without the arch_prctl permission
// the first tile instruction raises SIGILL.
//
// Every tile is configured as 16 rows x 64 bytes. TDPBF16PS C += A B multiplies A (16 rows of 32 bf16: 16 pairs)
// by B (16 rows, one per pair k, of 16 pairs: B[k][2n], B[k][2n + 1] are the pair's two elements for output n)
// into C (16 x 16 fp32): C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1].
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && defined(__AVX512BF16__) && (defined(__GNUC__) || defined(__clang__))
#define LS_AMX_HW 1
#endif

namespace leanserve {
namespace amx {

constexpr int kTiles = 8, kTileRows = 16, kTileBytes = 64;

// The 64-byte tile configuration of LDTILECFG (palette 1): every tile used as 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < kTiles; ++t) colsb[t] = kTileBytes, rows[t] = kTileRows;
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#define LS_TILE_CASES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

#ifdef LS_AMX_HW
// The hardware tiles. Tile state is per thread: each thread that runs a tile program calls begin() first and
// end() after. AT&T operand order: tdpbf16ps %tmmB, %tmmA, %tmmC is C += A B.
struct HardwareTiles {
  static void begin() {
    static const TileConfig config;
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
  }
  static void end() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void zero() {
#define LS_CASE(n) if constexpr (T == n) __asm__ volatile("tilezero %%tmm" #n ::);
    LS_TILE_CASES(LS_CASE)
#undef LS_CASE
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
#define LS_CASE(n) \
  if constexpr (T == n) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #n ::"r"(p), "r"(stride) : "memory");
    LS_TILE_CASES(LS_CASE)
#undef LS_CASE
  }
  template <int T>
  static void store(void* p, int64_t stride) {
#define LS_CASE(n) \
  if constexpr (T == n) __asm__ volatile("tilestored %%tmm" #n ", (%0,%1,1)" ::"r"(p), "r"(stride) : "memory");
    LS_TILE_CASES(LS_CASE)
#undef LS_CASE
  }
  template <int C, int A, int B>
  static void dot() {
    static_assert(C != A && C != B && A != B && C >= 0 && A >= 0 && B >= 0 && C < 8 && A < 8 && B < 8,
                  "TDPBF16PS needs three distinct tiles");
#define LS_DOT(c, a, b) \
  if constexpr (C == c && A == a && B == b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::);
#define LS_DOT_B(c, a) LS_DOT(c, a, 0) LS_DOT(c, a, 1) LS_DOT(c, a, 2) LS_DOT(c, a, 3) LS_DOT(c, a, 4) \
  LS_DOT(c, a, 5) LS_DOT(c, a, 6) LS_DOT(c, a, 7)
#define LS_DOT_A(c) LS_DOT_B(c, 0) LS_DOT_B(c, 1) LS_DOT_B(c, 2) LS_DOT_B(c, 3) LS_DOT_B(c, 4) LS_DOT_B(c, 5) \
  LS_DOT_B(c, 6) LS_DOT_B(c, 7)
    LS_TILE_CASES(LS_DOT_A)
#undef LS_DOT_A
#undef LS_DOT_B
#undef LS_DOT
  }
};
#endif

// A scalar model of the tiles (per thread), following the Intel SDM pseudocode of the instructions.
struct EmulatedTiles {
  alignas(64) static inline thread_local uint8_t regs[kTiles][kTileRows * kTileBytes];
  static float bf16(uint16_t b) {
    if ((b & 0x7F80) == 0) return 0.f;  // DAZ: a zero exponent (zero or subnormal) reads as zero
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static void begin() {}
  static void end() {}
  template <int T>
  static void zero() { std::memset(regs[T], 0, sizeof(regs[T])); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(regs[T] + r * kTileBytes, static_cast<const uint8_t*>(p) + r * stride, kTileBytes);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, regs[T] + r * kTileBytes, kTileBytes);
  }
  template <int C, int A, int B>
  static void dot() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS needs three distinct tiles");
    float c[kTileRows][16];
    uint16_t a[kTileRows][32], b[kTileRows][32];
    std::memcpy(c, regs[C], sizeof(c));
    std::memcpy(a, regs[A], sizeof(a));
    std::memcpy(b, regs[B], sizeof(b));
    for (int m = 0; m < kTileRows; ++m) {
      for (int k = 0; k < 16; ++k) {  // pairs of k in order, as the pseudocode's loop; n innermost
        for (int n = 0; n < 16; ++n) {
          float t = c[m][n] + bf16(a[m][2 * k]) * bf16(b[k][2 * n]);
          t = t + bf16(a[m][2 * k + 1]) * bf16(b[k][2 * n + 1]);
          c[m][n] = t;
        }
      }
      for (int n = 0; n < 16; ++n)
        if (c[m][n] != 0.f && std::abs(c[m][n]) < 1.17549435e-38f) c[m][n] = std::copysign(0.f, c[m][n]);  // FTZ
    }
    std::memcpy(regs[C], c, sizeof(c));
  }
};

#undef LS_TILE_CASES

}  // namespace amx
}  // namespace leanserve
