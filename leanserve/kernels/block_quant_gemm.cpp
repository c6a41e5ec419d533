// Matrix products with GGUF block-quantized weights kept in their file layout (ggml's Q4_1 / Q4_0 / Q8_0 blocks of
// 32 weights, split into a codes array and fp16 scale arrays), for small and large batches on CPU.
//
// y[m, n] = sum_k x[m, k] * w[n, k], w dequantized per block b of 32 inputs:
//   4-bit: w = d[n, b] * q + mn[n, b]      (q in 0..15; Q4_0 is stored with mn = -8 d, which is exact in fp16)
//   8-bit: w = d[n, b] * q                  (q in -128..127, Q8_0)
// Activations are quantized per row and block to int16 (dx = max|x| / 32767, relative error <= 2**-16 of the
// block's largest value, far below fp32 GEMM noise at these widths), so each block's dot product is an exact int32
// sum of int16 x 16-bit products (AVX2 vpmaddwd + vpaddd, or one AVX-512 VNNI / AVX-VNNI vpdpwssd where the build
// targets a CPU that has it: the same int32 sums, so both paths give bit-identical results), scaled once per block
// in fp32:
//   y = sum_b d[n, b] * dx[m, b] * sum_j q[n, j] * xq[m, j]  +  sum_b mn[n, b] * sum_j x[m, j]   (the second sum in fp32).
// This is llama.cpp's scheme (ggml_vec_dot_q4_1_q8_1) with 16-bit instead of 8-bit activations.
//
// Layouts (row-major, contiguous):
//   x       [M, K] float32, K % 32 == 0
//   packed  [N, K / 2] uint8 for 4-bit: byte j of block b holds element b*32 + j in its low nibble and b*32 + j + 16
//           in its high nibble (ggml's order); codes [N, K] int8 for 8-bit
//   d, mn   [N, K / 32] float16 (mn empty for 8-bit)
// Returns y [M, N] float32. Rows of x are independent: a row's result does not depend on M or on the other rows.
#include <torch/extension.h>
#include "block_amax.h"
#include "out_rows.h"
#include "spin_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LS_AVX2 1
#endif

namespace {

// The cache hint of the lane kernels' software prefetch (set_lane_prefetch_hint): false = T0, true = NTA.
std::atomic<bool> g_prefetch_nta{false};

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 16;  // output rows sharing one pass over a tile of activations (stays in L1)
constexpr int64_t kMaxTile = 4;       // activation rows per register tile

inline float half_to_float(uint16_t h) {
#ifdef LS_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

#ifdef LS_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Per row m and block b: xq = round(x / dx) in int16, dx = max|x| / 32767, xs = sum(x).
void quantize_activations(const float* x, int64_t M, int64_t K, int16_t* xq, float* dx, float* xs) {
  const int64_t nb = K / kBlock;
  leanserve::SpinPool::parallel_for(M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * kBlock;
#ifdef LS_AVX2
        __m256 v[4], sv = _mm256_setzero_ps();
        const float amax_v = leanserve::load_block_amax(xb, v);
        for (int j = 0; j < 4; ++j) sv = _mm256_add_ps(sv, v[j]);
        const float dv = amax_v / 32767.f;
        const __m256 iv = _mm256_set1_ps(dv > 0.f ? 1.f / dv : 0.f);
        int16_t* qv = xq + m * K + b * kBlock;
        for (int j = 0; j < 4; j += 2) {  // round to nearest (even), saturate to int16
          const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
          const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], iv));
          const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qv + 8 * j), packed);
        }
        dx[m * nb + b] = dv;
        xs[m * nb + b] = hsum(sv);
        continue;
#endif
        float amax = 0.f, sum = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) {
          amax = std::max(amax, std::fabs(xb[j]));
          sum += xb[j];
        }
        const float d = amax / 32767.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int16_t* qb = xq + m * K + b * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          const float v = std::nearbyint(xb[j] * inv);
          qb[j] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, v)));
        }
        dx[m * nb + b] = d;
        xs[m * nb + b] = sum;
      }
    }
  });
}


// x [M, K] float32 checked and quantized for the kernels (both entry points): xq, dx, xs as quantize_activations.
struct QuantizedRows {
  int64_t M, K, nb;
  std::vector<int16_t> xq;
  std::vector<float> dx, xs;

  QuantizedRows(const torch::Tensor& x, int64_t bits) {
    TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "x must be [M, K] float32");
    TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
    M = x.size(0);
    K = x.size(1);
    nb = K / kBlock;
    xq.resize(M * K);
    dx.resize(M * nb);
    xs.resize(M * nb);
    auto xc = x.contiguous();
    quantize_activations(xc.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
  }
};

// One output row n against T activation rows: out[t * N] for t < T. kBits = 4 or 8.
template <int kBits, int T>
inline void row_tile(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, const int16_t* xq,
                     const float* dx, const float* xs, int64_t K, float* out, int64_t N) {
  float bias[T];
  for (int t = 0; t < T; ++t) bias[t] = 0.f;
#ifdef LS_AVX2
  // two accumulators per row (even and odd blocks) hide the FMA latency at T = 1
  __m256 acc0[T], acc1[T];
  for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  auto block = [&](int64_t b, __m256* acc) {
    __m256i w0, w1;
    if constexpr (kBits == 4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + b * 16));
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    } else {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * 32));
      w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
      w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
    }
    const float d = half_to_float(wd[b]);
    for (int t = 0; t < T; ++t) {
      const int16_t* xb = xq + t * K + b * kBlock;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[t * nb + b]), acc[t]);
    }
  };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    block(b, acc0);
    block(b + 1, acc1);
  }
  if (b < nb) block(b, acc0);
  if constexpr (kBits == 4) {  // sum_b mn[b] * xs[t, b], 8 blocks at a time
    int64_t c = 0;
    __m256 bv[T];
    for (int t = 0; t < T; ++t) bv[t] = _mm256_setzero_ps();
    for (; c + 8 <= nb; c += 8) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + c)));
      for (int t = 0; t < T; ++t) bv[t] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + t * nb + c), bv[t]);
    }
    for (int t = 0; t < T; ++t) {
      bias[t] = hsum(bv[t]);
      for (int64_t r = c; r < nb; ++r) bias[t] += half_to_float(wm[r]) * xs[t * nb + r];
    }
  }
  for (int t = 0; t < T; ++t) out[t * N] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + bias[t];
#else
  float acc[T];
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t q[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      if constexpr (kBits == 4) {
        const uint8_t byte = wq[b * 16 + (j & 15)];
        q[j] = j < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        q[j] = static_cast<int8_t>(wq[b * 32 + j]);
      }
    }
    const float d = half_to_float(wd[b]);
    const float mn = kBits == 4 ? half_to_float(wm[b]) : 0.f;
    for (int t = 0; t < T; ++t) {
      const int16_t* xb = xq + t * K + b * kBlock;
      int32_t s = 0;
      for (int64_t j = 0; j < kBlock; ++j) s += q[j] * xb[j];
      acc[t] += static_cast<float>(s) * (d * dx[t * nb + b]);
      if constexpr (kBits == 4) bias[t] += mn * xs[t * nb + b];
    }
  }
  for (int t = 0; t < T; ++t) out[t * N] = acc[t] + bias[t];
#endif
}

template <int kBits>
void gemm(const int16_t* xq, const float* dx, const float* xs, int64_t M, int64_t K, const uint8_t* wq,
          const uint16_t* wd, const uint16_t* wm, int64_t N, float* y) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = kBits == 4 ? K / 2 : K;
  leanserve::SpinPool::parallel_for((N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int64_t rows = std::min(kMaxTile, M - m0);
        const int16_t* xt = xq + m0 * K;
        const float* dt = dx + m0 * nb;
        const float* st = xs + m0 * nb;
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* wr = wq + n * row_bytes;
          const uint16_t* dr = wd + n * nb;
          const uint16_t* mr = kBits == 4 ? wm + n * nb : nullptr;
          float* out = y + m0 * N + n;
          switch (rows) {
            case 4: row_tile<kBits, 4>(wr, dr, mr, nb, xt, dt, st, K, out, N); break;
            case 3: row_tile<kBits, 3>(wr, dr, mr, nb, xt, dt, st, K, out, N); break;
            case 2: row_tile<kBits, 2>(wr, dr, mr, nb, xt, dt, st, K, out, N); break;
            default: row_tile<kBits, 1>(wr, dr, mr, nb, xt, dt, st, K, out, N); break;
          }
        }
      }
    }
  });
}

// ---- Weights in lane order ---------------------------------------------------------------------------------------
// The kernel above converts every (row, output, block) dot product to float separately, which costs more than the
// fp32 GEMM's FMAs once there are more than a few rows. Here 8 outputs sit in the 8 int32 lanes of one register:
// lane l accumulates q[n0 + l, k] * xq[m, k] for k = 2p, 2p + 1 (vpmaddwd of the weights' int16 pair against the
// activations' pair broadcast to all lanes), over the 16 pairs of a block in exact int32, then once per block
//   y[m, n0 + l] += float(acc) * (d[n0 + l, b] * dx[m, b]) + mn[n0 + l, b] * xs[m, b].
// Register tiles: with AVX-512 VNNI, 2-8 rows x 32 outputs (zmm: 16 int32 lanes = 2 groups, vpdpwssd), one row x
// 64 outputs; with AVX2, 2-3 rows x 16 outputs, one row x 64 outputs. Each row's result depends only on that row
// (its int32 sums are exact, and its fp32 steps are the same instructions in the same order whatever M, the tile
// and the row's place in it), bitwise equal on both paths. The same bytes as the file, so one step reads as much
// memory as the block kernel: it serves every M.
//
// Lane layout (the file's bytes and scales, permuted once at load), in tiles of 64 outputs = 8 groups of 8 whose
// bytes for a block are contiguous, so that a task streams one region instead of one per group (8 concurrent
// streams defeated the hardware prefetcher when the weights come from DRAM: single-row decode ran ~15% slower):
//   4-bit: lanes [N / 64, K / 32, 8, 8, 8, 2] uint8, (t, b, g, p, l, i) = byte 2p + i of block b of output
//          n = 64t + 8g + l, i.e. q[n, 32b + 2p + i] in the low nibble and q[n, 32b + 16 + 2p + i] in the high one
//          (ggml's order);
//   8-bit: lanes [N / 64, K / 32, 8, 16, 8, 2] int8, (t, b, g, p, l, i) = q[64t + 8g + l, 32b + 2p + i];
//   dl, ml [N / 64, K / 32, 8, 8] float16: d and mn of output 64t + 8g + l, block b (ml unused for 8-bit).

constexpr int64_t kLaneRowsPerTask = 96;  // activation rows per task (~110 KB of int16 at K = 576: stays in L2)

#ifdef LS_AVX2
// acc + the pairwise int16 dot products of a and b (int32 lanes): one AVX-512 VNNI instruction where the build
// has it, else AVX2's multiply-add then add.
inline __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline __m256i bcast_pair(const int16_t* p) {  // xq[k], xq[k + 1] in every int32 lane
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm256_set1_epi32(pair);
}
#endif

#ifdef LS_AVX2
// Software prefetch of the weights kLaneAhead blocks ahead of block b (the tile's blocks, then the next tile's, are
// contiguous): the bytes of groups [g0, g1) of that block. A decode step streams ~97 MB of weights from DRAM; the
// hardware prefetcher alone left one thread at ~2/3 of the bandwidth it reaches with this (benchmarks.step_profile
// / benchmarks.quant --b1-only).
constexpr int64_t kLaneAhead = 4;
template <int64_t kBlockBytes>
inline void prefetch_ahead(const uint8_t* wl, int64_t b, int g0, int g1) {
  const char* ahead = reinterpret_cast<const char*>(wl + ((b + kLaneAhead) * 8 + g0) * kBlockBytes);
  if (g_prefetch_nta.load(std::memory_order_relaxed)) {
    for (int64_t c = 0; c < (g1 - g0) * kBlockBytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_NTA);
  } else {
    for (int64_t c = 0; c < (g1 - g0) * kBlockBytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
  }
}
#endif

#if defined(LS_AVX2) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LS_AVX512_LANE 1
// lane_tile for one row with 512-bit registers, groups [g0, g0 + G) of the tile: one zmm holds two pairs (p, p + 1) of
// a group's 8 outputs (lanes 0-7 and 8-15, the 32 contiguous bytes of the layout), against the row's pairs p and
// p + 1 (vpermd of the block's 16 pairs); at the end of a block the two halves are added. The int32 sums are the
// same integers as the 256-bit path's (integer addition is exact in any order), and the fp32 steps that follow are
// the same instructions, so the result is bitwise equal to it, in half the multiply-add instructions.
template <int kBits, int G>
inline void lane_tile1_avx512(const uint8_t* wl, const uint16_t* dl, const uint16_t* ml, int64_t nb,
                              const int16_t* xq, const float* dx, const float* xs, float* y, int g0,
                              bool prefetch) {
  constexpr int64_t kBlockBytes = kBits == 4 ? 128 : 256;
  constexpr int kPairs = kBits == 4 ? 4 : 8;  // zmm loads per group and block (two pairs each)
  __m256 acc[G];  // compile-time indices: in registers
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch) prefetch_ahead<kBlockBytes>(wl, b, g0, g0 + G);
    const __m512i xb = _mm512_loadu_si512(xq + b * kBlock);  // the block's 16 pairs
    __m512i xv[kBits == 4 ? 8 : 8];
    for (int j = 0; j < kPairs; ++j) {  // pairs (2j, 2j + 1); for 4-bit also (8 + 2j, 9 + 2j), the high nibbles
      xv[j] = _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(2 * j)), xb);
      if constexpr (kBits == 4)
        xv[4 + j] = _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(8 + 2 * j)), xb);
    }
    const uint8_t* wb = wl + (b * 8 + g0) * kBlockBytes;
    for (int g = 0; g < G; ++g) {
      __m512i a = _mm512_setzero_si512();
      for (int j = 0; j < kPairs; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * kBlockBytes + j * 32));
        if constexpr (kBits == 4) {
          const __m512i v = _mm512_cvtepu8_epi16(raw);
          a = _mm512_dpwssd_epi32(a, _mm512_and_si512(v, low4), xv[j]);
          a = _mm512_dpwssd_epi32(a, _mm512_srli_epi16(v, 4), xv[4 + j]);
        } else {
          a = _mm512_dpwssd_epi32(a, _mm512_cvtepi8_epi16(raw), xv[j]);
        }
      }
      const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
      const int64_t at = b * 64 + (g0 + g) * 8;
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dl + at)));
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(dx[b])), acc[g]);
      if constexpr (kBits == 4) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ml + at)));
        acc[g] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[b]), acc[g]);
      }
    }
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_ps(y + (g0 + g) * 8, acc[g]);
}

inline __m512i bcast_pair512(const int16_t* p) {  // xq[k], xq[k + 1] in every int32 lane
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// lane_tile for T >= 2 rows with 512-bit registers, the NQ group pairs from group g0 (even) of the tile, in register
// sub-tiles of Q group pairs: one zmm holds pair p of two groups g, g + 1 (lanes 0-7: group g's 8 outputs, 8-15:
// group g + 1's; two 16-byte loads of the layout), against row t's pair p broadcast to all lanes, so that every
// weight register, unpacked once, serves the T rows. Per block and group pair the zmm of int32 sums holds the same
// integers as the 256-bit path's two registers (exact in any order), and the fp32 steps that follow are the 256-bit
// path's instructions lane by lane (cvtdq2ps, d * dx, one FMA, then for 4-bit the offsets' FMA), in the same order
// over blocks, on 16 lanes at once: each row's result is bitwise equal to the 256-bit path's and to the one-row
// tile's, whatever T, Q and the row's place in the tile.
template <int kBits, int T, int Q, int NQ>
inline void lane_tile_avx512(const uint8_t* wl, const uint16_t* dl, const uint16_t* ml, int64_t nb,
                             const int16_t* xq, const float* dx, const float* xs, int64_t K, float* y, int64_t N,
                             int g0, bool prefetch) {
  constexpr int64_t kBlockBytes = kBits == 4 ? 128 : 256;
  constexpr int kP = kBits == 4 ? 8 : 16;  // 16-byte loads (8 outputs x one pair) per group and block
  __m512 acc[T][NQ];  // [row][group pair from g0]: compile-time indices
  for (int t = 0; t < T; ++t)
    for (int q = 0; q < NQ; ++q) acc[t][q] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch) prefetch_ahead<kBlockBytes>(wl, b, g0, g0 + 2 * NQ);
    const int16_t* xb = xq + b * kBlock;
    for (int q0 = 0; q0 < NQ; q0 += Q) {
      const uint8_t* wb = wl + (b * 8 + g0 + 2 * q0) * kBlockBytes;
      __m512i ai[T][Q];
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < Q; ++j) ai[t][j] = _mm512_setzero_si512();
      for (int p = 0; p < kP; ++p) {
        __m512i lo[Q], hi[Q];  // 4-bit: low nibbles = pair p, high nibbles = pair p + 8; 8-bit: lo = pair p
        for (int j = 0; j < Q; ++j) {
          const uint8_t* src = wb + 2 * j * kBlockBytes + p * 16;
          const __m256i raw = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + kBlockBytes)), 1);
          if constexpr (kBits == 4) {
            const __m512i v = _mm512_cvtepu8_epi16(raw);
            lo[j] = _mm512_and_si512(v, low4);
            hi[j] = _mm512_srli_epi16(v, 4);
          } else {
            lo[j] = _mm512_cvtepi8_epi16(raw);
          }
        }
        for (int t = 0; t < T; ++t) {
          const __m512i xa = bcast_pair512(xb + t * K + 2 * p);
          if constexpr (kBits == 4) {
            const __m512i xc = bcast_pair512(xb + t * K + 16 + 2 * p);
            for (int j = 0; j < Q; ++j) ai[t][j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(ai[t][j], lo[j], xa),
                                                                       hi[j], xc);
          } else {
            for (int j = 0; j < Q; ++j) ai[t][j] = _mm512_dpwssd_epi32(ai[t][j], lo[j], xa);
          }
        }
      }
      for (int j = 0; j < Q; ++j) {
        const int64_t at = b * 64 + (g0 + 2 * (q0 + j)) * 8;  // the 16 scales of the group pair
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dl + at)));
        for (int t = 0; t < T; ++t)
          acc[t][q0 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[t][j]),
                                           _mm512_mul_ps(dv, _mm512_set1_ps(dx[t * nb + b])), acc[t][q0 + j]);
        if constexpr (kBits == 4) {
          const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ml + at)));
          for (int t = 0; t < T; ++t)
            acc[t][q0 + j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[t * nb + b]), acc[t][q0 + j]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int q = 0; q < NQ; ++q) _mm512_storeu_ps(y + t * N + g0 * 8 + q * 16, acc[t][q]);
}
#endif

// One tile of 64 outputs (8 groups of 8), the G groups from gbeg of it, for T rows. Per block the tile's 8 groups
// are contiguous in memory and are walked in order, in register sub-tiles of S groups (8 or 4 for one row; 2 with
// 2-3 rows, where the T x S int32 sums and their weights would not fit in registers otherwise); the fp32 sums of the
// G groups live in acc. G is a multiple of S.
template <int kBits, int T, int S, int G>
inline void lane_tile(const uint8_t* wl, const uint16_t* dl, const uint16_t* ml, int64_t nb,
                      const int16_t* xq, const float* dx, const float* xs, int64_t K, float* y, int64_t N,
                      int gbeg, bool prefetch) {
  constexpr int64_t kBlockBytes = kBits == 4 ? 128 : 256;  // one block of 8 outputs
#ifdef LS_AVX2
  __m256 acc[T][G];  // [row][group from gbeg]: compile-time indices
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch) prefetch_ahead<kBlockBytes>(wl, b, gbeg, gbeg + G);
    const int16_t* xb = xq + b * kBlock;
    for (int g0 = 0; g0 < G; g0 += S) {
      const uint8_t* wb = wl + (b * 8 + gbeg + g0) * kBlockBytes;
      __m256i acci[T][S];
      for (int t = 0; t < T; ++t)
        for (int g = 0; g < S; ++g) acci[t][g] = _mm256_setzero_si256();
      if constexpr (kBits == 4) {
        for (int p = 0; p < 8; ++p) {
          __m256i lo[S], hi[S];  // 16-bit lanes: low nibbles = pair p, high nibbles = pair p + 8
          for (int g = 0; g < S; ++g) {
            const __m256i v = _mm256_cvtepu8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + g * kBlockBytes + p * 16)));
            lo[g] = _mm256_and_si256(v, low4);
            hi[g] = _mm256_srli_epi16(v, 4);
          }
          for (int t = 0; t < T; ++t) {
            const __m256i xa = bcast_pair(xb + t * K + 2 * p), xc = bcast_pair(xb + t * K + 16 + 2 * p);
            for (int g = 0; g < S; ++g)
              acci[t][g] = dot_acc(dot_acc(acci[t][g], lo[g], xa), hi[g], xc);
          }
        }
      } else {
        for (int p = 0; p < 16; ++p) {
          __m256i w[S];
          for (int g = 0; g < S; ++g)
            w[g] = _mm256_cvtepi8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + g * kBlockBytes + p * 16)));
          for (int t = 0; t < T; ++t) {
            const __m256i xv = bcast_pair(xb + t * K + 2 * p);
            for (int g = 0; g < S; ++g) acci[t][g] = dot_acc(acci[t][g], w[g], xv);
          }
        }
      }
      for (int g = 0; g < S; ++g) {
        const int64_t at = b * 64 + (gbeg + g0 + g) * 8;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dl + at)));
        for (int t = 0; t < T; ++t)
          acc[t][g0 + g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[t][g]),
                                           _mm256_mul_ps(dv, _mm256_set1_ps(dx[t * nb + b])), acc[t][g0 + g]);
        if constexpr (kBits == 4) {
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ml + at)));
          for (int t = 0; t < T; ++t)
            acc[t][g0 + g] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[t * nb + b]), acc[t][g0 + g]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(y + t * N + (gbeg + g) * 8, acc[t][g]);
#else
  for (int t = 0; t < T; ++t)
    for (int g = gbeg; g < gbeg + G; ++g)
      for (int l = 0; l < 8; ++l) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t s = 0;
          for (int64_t k = 0; k < kBlock; ++k) {
            int32_t q;
            if constexpr (kBits == 4) {
              const int64_t j = k & 15;  // byte j = 2p + i of the block
              const uint8_t raw = wl[(b * 8 + g) * kBlockBytes + (j / 2) * 16 + l * 2 + j % 2];
              q = k < 16 ? (raw & 0x0F) : (raw >> 4);
            } else {
              q = static_cast<int8_t>(wl[(b * 8 + g) * kBlockBytes + (k / 2) * 16 + l * 2 + k % 2]);
            }
            s += q * xq[t * K + b * kBlock + k];
          }
          const float d = half_to_float(dl[b * 64 + g * 8 + l]);
          acc += static_cast<float>(s) * (d * dx[t * nb + b]);
          if (kBits == 4) acc += half_to_float(ml[b * 64 + g * 8 + l]) * xs[t * nb + b];
        }
        y[t * N + g * 8 + l] = acc;
      }
#endif
}

// Rows per register tile: with AVX-512 up to 8 (so that 1 + k verification rows, k <= 7, stream each weight tile
// once, and a larger batch unpacks a weight register once per 8 rows; 12-row tiles measured no faster), else 3
// (16 ymm registers).
#ifdef LS_AVX512_LANE
constexpr int64_t kLaneTileRows = 8;
#else
constexpr int64_t kLaneTileRows = 3;
#endif

// T rows (1 <= T <= kLaneTileRows) of groups [g0, g1) (4 or 8 groups) of one tile.
template <int kBits>
inline void lane_rows(int64_t T, const uint8_t* wl, const uint16_t* dl, const uint16_t* ml, int64_t nb,
                      const int16_t* xq, const float* dx, const float* xs, int64_t K, float* y, int64_t N, int g0,
                      int g1, bool prefetch) {
  const bool whole = g1 - g0 == 8;
#ifdef LS_AVX512_LANE
  switch (T) {  // whole tiles: sub-tiles of 4 group pairs for 2-4 rows (8-16 int32 sums), 2 pairs above
#define LS_CASE(n, q)                                                                                             \
  case n:                                                                                                         \
    if (whole) lane_tile_avx512<kBits, n, q, 4>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);               \
    else lane_tile_avx512<kBits, n, 2, 2>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);                    \
    return;
    LS_CASE(2, 4) LS_CASE(3, 4) LS_CASE(4, 4) LS_CASE(5, 2) LS_CASE(6, 2) LS_CASE(7, 2) LS_CASE(8, 2)
#undef LS_CASE
    default:
      if (whole) lane_tile1_avx512<kBits, 8>(wl, dl, ml, nb, xq, dx, xs, y, g0, prefetch);
      else lane_tile1_avx512<kBits, 4>(wl, dl, ml, nb, xq, dx, xs, y, g0, prefetch);
      return;
  }
#else
  switch (T) {
    case 3:
      if (whole) lane_tile<kBits, 3, 2, 8>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      else lane_tile<kBits, 3, 2, 4>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      return;
    case 2:
      if (whole) lane_tile<kBits, 2, 2, 8>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      else lane_tile<kBits, 2, 2, 4>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      return;
    default:
      if (whole) lane_tile<kBits, 1, 8, 8>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      else lane_tile<kBits, 1, 4, 4>(wl, dl, ml, nb, xq, dx, xs, K, y, N, g0, prefetch);
      return;
  }
#endif
}

template <int kBits>
void lane_gemm_impl(const int16_t* xq, const float* dx, const float* xs, int64_t M, int64_t K, const uint8_t* lanes,
                    const uint16_t* dl, const uint16_t* ml, int64_t N, float* y) {
  constexpr int64_t kBlockBytes = kBits == 4 ? 128 : 256;
  const int64_t nb = K / kBlock, tiles = N / 64;
  const int64_t tile_bytes = nb * 8 * kBlockBytes, tile_scales = nb * 64;
  // A task: groups [g0, g1) of one tile of 64 outputs (one contiguous region of weights, streamed once and reused
  // from cache) for an m-block of rows, walked in register tiles of at most kLaneTileRows rows of equal size.
  // Few rows (decode, the 1 + k rows of speculative verification): one m-block, so that each weight byte is streamed
  // once, and the threads split the outputs; a tile is split in two halves of 4 groups when the task count is not
  // a multiple of the pool's threads (e.g. 9 or 15 tiles on 2 threads), so that the threads get equal shares. Many
  // rows: m-blocks of at most kLaneRowsPerTask rows, whose activations stay in L2.
  const int64_t mblocks = (M + kLaneRowsPerTask - 1) / kLaneRowsPerTask;
  const int64_t mrows = (M + mblocks - 1) / mblocks;
  const int64_t threads = at::get_num_threads();
  const int64_t halves = threads > 1 && (mblocks * tiles) % threads ? 2 : 1;
  const int64_t per_mb = tiles * halves;
  leanserve::SpinPool::parallel_for(mblocks * per_mb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task / per_mb, t = task % per_mb / halves, h = task % halves;
      const int g0 = static_cast<int>(h * 8 / halves), g1 = static_cast<int>((h + 1) * 8 / halves);
      const uint8_t* wl = lanes + t * tile_bytes;
      const uint16_t* dt = dl + t * tile_scales;
      const uint16_t* mt = ml + t * tile_scales;
      const int64_t m_begin = mb * mrows, m_end = std::min(M, m_begin + mrows);
      const int64_t passes = (m_end - m_begin + kLaneTileRows - 1) / kLaneTileRows;
      for (int64_t i = 0; i < passes; ++i) {  // register tiles of equal size (within one row)
        const int64_t m0 = m_begin + (m_end - m_begin) * i / passes;
        const int64_t m1 = m_begin + (m_end - m_begin) * (i + 1) / passes;
        // the task's first pass streams the tile: prefetch it then only
        lane_rows<kBits>(m1 - m0, wl, dt, mt, nb, xq + m0 * K, dx + m0 * nb, xs + m0 * nb, K, y + m0 * N + t * 64,
                         N, g0, g1, i == 0);
      }
    }
  });
}

}  // namespace

torch::Tensor block_quant_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor mn,
                               int64_t bits) {
  QuantizedRows xr(x, bits);
  const int64_t M = xr.M, K = xr.K, N = codes.size(0), nb = xr.nb;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == (bits == 4 ? K / 2 : K) &&
              codes.element_size() == 1, "codes must be [N, K/2] uint8 (4-bit) or [N, K] int8 (8-bit)");
  TORCH_CHECK(d.is_contiguous() && d.dtype() == torch::kFloat16 && d.size(0) == N && d.size(1) == nb,
              "d must be [N, K/32] float16");
  TORCH_CHECK(bits == 8 || (mn.is_contiguous() && mn.dtype() == torch::kFloat16 && mn.sizes() == d.sizes()),
              "mn must be [N, K/32] float16");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* wq = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  if (bits == 4) {
    const auto* wm = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
    gemm<4>(xr.xq.data(), xr.dx.data(), xr.xs.data(), M, K, wq, wd, wm, N, y.data_ptr<float>());
  } else {
    gemm<8>(xr.xq.data(), xr.dx.data(), xr.xs.data(), M, K, wq, wd, nullptr, N, y.data_ptr<float>());
  }
  return y;
}

// w [N, K] float32 from codes and scales, written into out (>= N * K float32 elements, e.g. a scratch buffer that
// stays in cache) when it is non-empty, else into a new tensor.
torch::Tensor block_dequantize(torch::Tensor codes, torch::Tensor d, torch::Tensor mn, int64_t bits,
                               torch::Tensor out_buf) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.element_size() == 1, "codes must be 2-D bytes");
  const int64_t N = codes.size(0), K = bits == 4 ? codes.size(1) * 2 : codes.size(1), nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && d.is_contiguous() && d.dtype() == torch::kFloat16 && d.size(0) == N &&
              d.size(1) == nb, "d must be [N, K/32] float16");
  TORCH_CHECK(bits == 8 || (mn.is_contiguous() && mn.dtype() == torch::kFloat16 && mn.sizes() == d.sizes()),
              "mn must be [N, K/32] float16");
  torch::Tensor w;
  if (out_buf.numel() > 0) {
    TORCH_CHECK(out_buf.dtype() == torch::kFloat32 && out_buf.is_contiguous() && out_buf.numel() >= N * K,
                "out must be a contiguous float32 buffer of at least N * K elements");
    w = out_buf.view(-1).narrow(0, 0, N * K).view({N, K});
  } else {
    w = torch::empty({N, K}, d.options().dtype(torch::kFloat32));
  }
  const auto* wq = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* wm = bits == 4 ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  float* out = w.data_ptr<float>();
  leanserve::SpinPool::parallel_for(N * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block i = row i / nb, block i % nb
      const float dd = half_to_float(wd[i]);
      float* o = out + i * kBlock;
#ifdef LS_AVX2
      const __m256 dv = _mm256_set1_ps(dd);
      if (bits == 4) {
        const __m256 mv = _mm256_set1_ps(half_to_float(wm[i]));
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + i * 16));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; ++j) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
          _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(dv, q), mv));  // d * q + m, as gguf-py
        }
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + i * kBlock));
        const __m128i halves[2] = {_mm256_castsi256_si128(raw), _mm256_extracti128_si256(raw, 1)};
        for (int j = 0; j < 4; ++j) {
          const __m128i src = j % 2 ? _mm_srli_si128(halves[j / 2], 8) : halves[j / 2];
          _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(src)), dv));
        }
      }
      continue;
#endif
      if (bits == 4) {
        const float m = half_to_float(wm[i]);
        const uint8_t* q = wq + i * 16;
        for (int64_t j = 0; j < 16; ++j) {
          o[j] = dd * static_cast<float>(q[j] & 0x0F) + m;
          o[j + 16] = dd * static_cast<float>(q[j] >> 4) + m;
        }
      } else {
        const auto* q = reinterpret_cast<const int8_t*>(wq + i * kBlock);
        for (int64_t j = 0; j < kBlock; ++j) o[j] = static_cast<float>(q[j]) * dd;
      }
    }
  }, /*spin=*/false);
  return w;
}

// x [M, K] float32 @ w.T with w in lane layout (see lane_tile): lanes [N / 64, K / 32, 8, 8 (4-bit) or 16 (8-bit), 8, 2]
// bytes, dl and ml [N / 64, K / 32, 8, 8] float16 (ml empty for 8-bit). Returns y [M, N] float32: out when given
// (a contiguous [M, N] float32 tensor, e.g. a block of rows of a larger output), else a new tensor.
torch::Tensor lane_quant_gemm(torch::Tensor x, torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml,
                              int64_t bits, c10::optional<torch::Tensor> out) {
  QuantizedRows xr(x, bits);
  const int64_t M = xr.M, K = xr.K, nb = xr.nb;
  TORCH_CHECK(lanes.is_contiguous() && lanes.dim() == 6 && lanes.size(1) == nb && lanes.size(2) == 8 &&
              lanes.size(3) == (bits == 4 ? 8 : 16) && lanes.size(4) == 8 && lanes.size(5) == 2 &&
              lanes.element_size() == 1, "lanes must be [N/64, K/32, 8, 8 or 16, 8, 2] bytes");
  const int64_t N = lanes.size(0) * 64;
  TORCH_CHECK(dl.is_contiguous() && dl.dtype() == torch::kFloat16 && dl.numel() == N * nb,
              "dl must be [N/64, K/32, 8, 8] float16");
  TORCH_CHECK(bits == 8 || (ml.is_contiguous() && ml.dtype() == torch::kFloat16 && ml.numel() == N * nb),
              "ml must be [N/64, K/32, 8, 8] float16 for 4-bit weights");
  auto y = leanserve::output_rows(out, M, N, x.options());
  if (M == 0) return y;  // no rows: nothing to split into tasks
  const auto* wl = static_cast<const uint8_t*>(lanes.data_ptr());
  const auto* d = reinterpret_cast<const uint16_t*>(dl.data_ptr<at::Half>());
  if (bits == 4) {
    const auto* m = reinterpret_cast<const uint16_t*>(ml.data_ptr<at::Half>());
    lane_gemm_impl<4>(xr.xq.data(), xr.dx.data(), xr.xs.data(), M, K, wl, d, m, N, y.data_ptr<float>());
  } else {  // no offsets: ml is not read
    lane_gemm_impl<8>(xr.xq.data(), xr.dx.data(), xr.xs.data(), M, K, wl, d, d, N, y.data_ptr<float>());
  }
  return y;
}

// The lane kernels' software prefetch hint, process-wide: "t0" (into every cache level) or "nta" (non-temporal:
// weights streamed through a cache smaller than them need not evict what could stay). Raises on another value.
void set_lane_prefetch_hint(const std::string& hint) {
  TORCH_CHECK(hint == "t0" || hint == "nta", "lane prefetch hint must be t0 or nta, got ", hint);
  g_prefetch_nta.store(hint == "nta", std::memory_order_relaxed);
}

std::string lane_prefetch_hint() { return g_prefetch_nta.load(std::memory_order_relaxed) ? "nta" : "t0"; }
