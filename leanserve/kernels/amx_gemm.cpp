// bf16_gemm on Intel AMX tiles (see amx_gemm.h for the contract, lane_dequant.cpp for the operand layout).
//
// AMX holds eight tile registers of up to 16 rows x 64 bytes; TDPBF16PS C += A B multiplies a 16 x 32 bf16 tile A
// (16 rows of x, 32 consecutive k) by a B tile of 16 rows of 16 pairs (the pair-packed layout of w is exactly B's
// "VNNI" layout: one 64-byte row holds the pair (k, k + 1) of 16 consecutive outputs) into 16 x 16 fp32 sums.
// Program (bf16): a 32-row x 32-output block per step of 32 k: A0 A1 (rows 0-15, 16-31), B0 B1 (outputs 0-15,
// 16-31), C00 C01 C10 C11; bf16x3: a 16-row x 32-output block, Ah Al, Bh0 Bh1 Bl0 Bl1, C0 C1, products per step
// in the order xh wh, xh wl, xl wh. Every output row depends on its own x row only, with the same instructions
// whatever M is, so a row's result is bitwise independent of the other rows (as the AVX512_BF16 engine's).
//
// The tiles (amx_tiles.h) are written as inline assembly, so this file builds everywhere; they run only after
// amx_bf16_status() == "ready". The emulated tiles run the same program on memory, for tests on machines without
// AMX.
#include "amx_gemm.h"
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "amx_tiles.h"

#ifdef LS_AMX_HW
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace leanserve {
namespace {

using amx::EmulatedTiles;
using amx::kTileRows;
#ifdef LS_AMX_HW
using amx::HardwareTiles;
#endif

// Stores a 16-row fp32 tile of an R-row block: straight into y when all 16 rows are real, else through a buffer.
template <class Tiles, int T>
inline void store_rows(float* y, int64_t N, int64_t rows) {
  if (rows >= kTileRows) {
    Tiles::template store<T>(y, N * 4);
    return;
  }
  alignas(64) float buf[kTileRows * 16];
  Tiles::template store<T>(buf, 64);
  for (int64_t r = 0; r < std::max<int64_t>(rows, 0); ++r) std::memcpy(y + r * N, buf + r * 16, 64);
}

constexpr int64_t kRowsPerTask = 128;  // rows of a task (a multiple of 32): their x tiles stay in L2

// bf16: 32 rows x 32 outputs per block. Task: up to kRowsPerTask rows x 32 outputs.
template <class Tiles>
void bf16_blocks(const uint16_t* xh, int64_t M, int64_t K, const uint16_t* wh, int64_t N, float* y, int64_t m_begin,
                 int64_t m_end, int64_t j) {
  const uint16_t* b0 = wh + (2 * j) * K * 16;  // panel 2j: pair kp of output o at (kp * 16 + o) * 2
  const uint16_t* b1 = b0 + K * 16;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    Tiles::template zero<2>();
    Tiles::template zero<3>();
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      Tiles::template load<4>(xh + m0 * K + k0, K * 2);
      Tiles::template load<5>(xh + (m0 + 16) * K + k0, K * 2);
      Tiles::template load<6>(b0 + k0 * 16, 64);
      Tiles::template load<7>(b1 + k0 * 16, 64);
      Tiles::template dot<0, 4, 6>();
      Tiles::template dot<1, 4, 7>();
      Tiles::template dot<2, 5, 6>();
      Tiles::template dot<3, 5, 7>();
    }
    float* yt = y + m0 * N + 32 * j;
    store_rows<Tiles, 0>(yt, N, M - m0);
    store_rows<Tiles, 1>(yt + 16, N, M - m0);
    store_rows<Tiles, 2>(yt + 16 * N, N, M - m0 - 16);
    store_rows<Tiles, 3>(yt + 16 * N + 16, N, M - m0 - 16);
  }
}

// bf16x3: 16 rows x 32 outputs per block.
template <class Tiles>
void bf16x3_blocks(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const uint16_t* wh,
                   const uint16_t* wl, int64_t N, float* y, int64_t m_begin, int64_t m_end, int64_t j) {
  const int64_t at = (2 * j) * K * 16;
  const uint16_t *h0 = wh + at, *h1 = wh + at + K * 16, *l0 = wl + at, *l1 = wl + at + K * 16;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      Tiles::template load<2>(xh + m0 * K + k0, K * 2);
      Tiles::template load<3>(xl + m0 * K + k0, K * 2);
      Tiles::template load<4>(h0 + k0 * 16, 64);
      Tiles::template load<5>(h1 + k0 * 16, 64);
      Tiles::template load<6>(l0 + k0 * 16, 64);
      Tiles::template load<7>(l1 + k0 * 16, 64);
      Tiles::template dot<0, 2, 4>();  // xh wh
      Tiles::template dot<0, 2, 6>();  // xh wl
      Tiles::template dot<0, 3, 4>();  // xl wh
      Tiles::template dot<1, 2, 5>();
      Tiles::template dot<1, 2, 7>();
      Tiles::template dot<1, 3, 5>();
    }
    float* yt = y + m0 * N + 32 * j;
    store_rows<Tiles, 0>(yt, N, M - m0);
    store_rows<Tiles, 1>(yt + 16, N, M - m0);
  }
}

template <class Tiles>
void run(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const uint16_t* wh, const uint16_t* wl,
         int64_t N, float* y) {
  const bool x3 = xl != nullptr && wl != nullptr;
  const int64_t cols = N / 32, mblocks = (M + kRowsPerTask - 1) / kRowsPerTask;
  // a task: 32 outputs for one block of rows; tasks ordered row block first (its x stays in L2 across outputs)
  SpinPool::parallel_for(mblocks * cols, 4, [&](int64_t begin, int64_t end) {
    Tiles::begin();  // tile state is per thread: each worker configures its own
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task / cols, j = task % cols;
      const int64_t m_begin = mb * kRowsPerTask, m_end = std::min(M, m_begin + kRowsPerTask);
      if (x3) bf16x3_blocks<Tiles>(xh, xl, M, K, wh, wl, N, y, m_begin, m_end, j);
      else bf16_blocks<Tiles>(xh, M, K, wh, N, y, m_begin, m_end, j);
    }
    Tiles::end();
  }, /*spin=*/false);
}

#ifdef LS_AMX_HW
std::string probe() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return "cpu";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return "os";  // OSXSAVE: XGETBV is usable
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return "os";  // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA)
  constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;  // <asm/prctl.h>, Linux >= 5.16
  if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return "permission";
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetPerm, &granted) != 0 || !(granted & (1ul << kXtileData))) return "permission";
  return "ready";
}
#endif

}  // namespace

std::string amx_bf16_status() {
#ifdef LS_AMX_HW
  static const std::string status = probe();
  return status;
#else
  return "build";
#endif
}

int64_t amx_row_block(bool x3) { return x3 ? 16 : 32; }

void amx_bf16_gemm(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const uint16_t* wh,
                   const uint16_t* wl, int64_t N, float* y, bool emulate) {
  if (emulate) {
    run<EmulatedTiles>(xh, xl, M, K, wh, wl, N, y);
    return;
  }
#ifdef LS_AMX_HW
  run<HardwareTiles>(xh, xl, M, K, wh, wl, N, y);
#else
  throw std::runtime_error("this build has no AMX engine (amx_bf16_status() is \"build\")");
#endif
}

}  // namespace leanserve
