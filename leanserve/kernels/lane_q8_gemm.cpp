// Prefill products of 4-bit lane-layout weights with int8 activations (--prefill-gemm int8): the AVX2 machines'
// fast prefill path, where the bf16 GEMM (lane_dequant.cpp) has no AVX512_BF16 to run on.
//
// y[m, n] = sum_b d[n, b] * dx[m, b] * sum_j q[n, j] * xq[m, j]  +  sum_b mn[n, b] * xs[m, b]
// with the activations quantized per row and block of 32 to int8: dx = max|x| / 127, xq = round(x / dx) (to
// nearest even), xs = dx * sum(xq): the exact product of the weights with the quantized activations (to fp32
// rounding). This is llama.cpp's ggml_vec_dot_q4_1_q8_1 scheme (q8_1 activations: their rounding is at most 2**-8
// of the block's largest value, against 2**-16 in lane_quant_gemm's int16).
//
// Why it is faster than lane_quant_gemm on AVX2: the weights' nibbles stay bytes. vpmaddubsw multiplies 32 unsigned
// nibbles by 32 signed activations and adds pairs into 16 int16 lanes: 32 products per instruction, against 16 for
// the int16 path's vpmaddwd, and no widening of the weights to 16 bits. The int16 lanes cannot overflow: a lane sums
// 8 pairs of one block, |sum| <= 8 * 2 * 15 * 127 = 30480 < 32767; vpmaddwd with ones then adds the lanes' pairs into
// exact int32 block sums. With AVX-VNNI or AVX-512 VNNI, vpdpbusd computes the same int32 sums in one instruction,
// so this kernel's products are bit-identical on every build.
//
// Weights: lane_quant_gemm's lane layout (block_quant_gemm.cpp), read as it is: a 32-byte load of a group's block
// holds pairs 2j and 2j + 1 of its 8 outputs; vpermq + vpshufb put output l's four bytes (inputs 4j..4j + 3 in the
// low nibbles, 16 + 4j.. in the high ones) in int32 lane l, against the row's four activations broadcast to every
// lane. Each task does that once for its tile (unpack_tile: 36 KB of bytes at K = 576, which stay in L1), and its
// register tiles of up to 8 rows read the unpacked bytes.
//
// Layouts: x [M, K] float32, K % 32 == 0; lanes [N / 64, K / 32, 8, 8, 8, 2] uint8, dl, ml [N / 64, K / 32, 8, 8]
// float16 (lane layout, 4-bit only). Returns y [M, N] float32 (out when given). A row's result depends only on that
// row: its int32 sums are exact and its fp32 steps are the same instructions in the same order whatever M and the
// row's place in its tile.
#include <torch/extension.h>
#include "block_amax.h"
#include "out_rows.h"
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LS_Q8_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = 128;    // one 4-bit block of one group of 8 outputs
constexpr int64_t kRowsPerTask = 96;    // activation rows per task (55 KB of int8 at K = 576)
constexpr int64_t kTileRows = 8;        // rows per register tile (2-8 measured: 8 fastest on AVX2)

inline float half_to_float(uint16_t h) {
#ifdef LS_Q8_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Per row m and block b: xq = round(x / dx) in int8, dx = max|x| / 127, xs = dx * sum(xq) (the quantized block's sum,
// as ggml's block_q8_1.s: with the exact sum(x) instead, the offset term mn * xs and the code term d * q . xq would
// see different activations, and Q4_1's codes (0..15, not centred) turn the int8 rounding into a bias: measured 2.5x
// the log-prob error on the default model).
void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t nb = K / kBlock;
  leanserve::SpinPool::parallel_for(M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * kBlock;
        int8_t* qb = xq + m * K + b * kBlock;
#ifdef LS_Q8_AVX2
        __m256 v[4];
        const float d = leanserve::load_block_amax(xb, v) / 127.f;
        const __m256 iv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
        __m256i i[4];
        for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));  // nearest even
        // packs work per 128-bit lane: the dword order 0 4 1 5 2 6 3 7 puts the 32 bytes back in order
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i si = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(si), _mm256_extracti128_si256(si, 1));
        s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
        dx[m * nb + b] = d;
        xs[m * nb + b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
#else
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          qb[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xb[j] * inv))));
          sum += qb[j];
        }
        dx[m * nb + b] = d;
        xs[m * nb + b] = d * static_cast<float>(sum);
#endif
      }
    }
  });
}

struct alignas(32) Chunk {  // 32 bytes, aligned for the unpacked tiles' aligned loads
  uint8_t bytes[32];
};

#ifdef LS_Q8_AVX2
inline __m256i bcast4(const int8_t* p) {  // p[0..3] in every int32 lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}
#endif

// The unpacked weights of groups [g0, g1) of one tile, for q8_tile: u [g1 - g0, nb, 4, 2, 32] uint8, where
// u[g, b, j, 0] holds output l's low nibbles of inputs 4j..4j + 3 of block b in bytes 4l..4l + 3 (int32 lane l)
// and u[g, b, j, 1] the high nibbles (inputs 16 + 4j..). Done once per task, shared by its register tiles.
void unpack_tile(const uint8_t* wl, int64_t nb, int g0, int g1, uint8_t* u) {
#ifdef LS_Q8_AVX2
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (int g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = wl + (b * 8 + g) * kBlockBytes;
      uint8_t* ub = u + ((g - g0) * nb + b) * 256;
      for (int j = 0; j < 4; ++j) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
        v = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), order);
        _mm256_store_si256(reinterpret_cast<__m256i*>(ub + 64 * j), _mm256_and_si256(v, low4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(ub + 64 * j + 32),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      }
    }
#else
  for (int g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 8; ++l)
          for (int c = 0; c < 4; ++c) {  // input 4j + c: pair 2j + c / 2, byte c % 2
            const uint8_t raw = wl[(b * 8 + g) * kBlockBytes + (2 * j + c / 2) * 16 + l * 2 + c % 2];
            uint8_t* ub = u + ((g - g0) * nb + b) * 256 + 64 * j + 4 * l + c;
            ub[0] = raw & 0x0F;
            ub[32] = raw >> 4;
          }
#endif
}

// T rows (xq, dx, xs at row strides K, nb, nb) x groups [g0, g1) of one tile of 64 outputs (u: unpack_tile's
// bytes; dl, ml: the tile's scales); y at row stride N, the tile's first output at y[0].
template <int T>
void q8_tile(const uint8_t* u, const uint16_t* dl, const uint16_t* ml, int64_t nb, const int8_t* xq,
             const float* dx, const float* xs, int64_t K, float* y, int64_t N, int g0, int g1) {
#ifdef LS_Q8_AVX2
#if !defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int g = g0; g < g1; ++g) {
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* ub = u + ((g - g0) * nb + b) * 256;
      const int8_t* xb = xq + b * kBlock;
      __m256i s[T];  // int32 block sums (VNNI) or int16 pair sums
      for (int j = 0; j < 4; ++j) {
        const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(ub + 64 * j));
        const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(ub + 64 * j + 32));
        for (int t = 0; t < T; ++t) {
          const __m256i xa = bcast4(xb + t * K + 4 * j), xc = bcast4(xb + t * K + 16 + 4 * j);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
          s[t] = _mm256_dpbusd_epi32(j ? s[t] : _mm256_setzero_si256(), lo, xa);
          s[t] = _mm256_dpbusd_epi32(s[t], hi, xc);
#elif defined(__AVXVNNI__)
          s[t] = _mm256_dpbusd_avx_epi32(j ? s[t] : _mm256_setzero_si256(), lo, xa);
          s[t] = _mm256_dpbusd_avx_epi32(s[t], hi, xc);
#else
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
          s[t] = j ? _mm256_add_epi16(s[t], p) : p;
#endif
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dl + b * 64 + g * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ml + b * 64 + g * 8)));
      for (int t = 0; t < T; ++t) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
        const __m256i sum = s[t];
#else
        const __m256i sum = _mm256_madd_epi16(s[t], ones);
#endif
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dv, _mm256_set1_ps(dx[t * nb + b])), acc[t]);
        acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * N + g * 8, acc[t]);
  }
#else
  for (int t = 0; t < T; ++t)
    for (int g = g0; g < g1; ++g)
      for (int l = 0; l < 8; ++l) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* ub = u + ((g - g0) * nb + b) * 256;
          int32_t s = 0;
          for (int j = 0; j < 4; ++j)
            for (int c = 0; c < 4; ++c)
              s += ub[64 * j + 4 * l + c] * xq[t * K + b * kBlock + 4 * j + c] +
                   ub[64 * j + 32 + 4 * l + c] * xq[t * K + b * kBlock + 16 + 4 * j + c];
          acc += static_cast<float>(s) * (half_to_float(dl[b * 64 + g * 8 + l]) * dx[t * nb + b]);
          acc += half_to_float(ml[b * 64 + g * 8 + l]) * xs[t * nb + b];
        }
        y[t * N + g * 8 + l] = acc;
      }
#endif
}

void q8_rows(int64_t T, const uint8_t* u, const uint16_t* dl, const uint16_t* ml, int64_t nb, const int8_t* xq,
             const float* dx, const float* xs, int64_t K, float* y, int64_t N, int g0, int g1) {
  switch (T) {
    case 8: q8_tile<8>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 7: q8_tile<7>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 6: q8_tile<6>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 5: q8_tile<5>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 4: q8_tile<4>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 3: q8_tile<3>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    case 2: q8_tile<2>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
    default: q8_tile<1>(u, dl, ml, nb, xq, dx, xs, K, y, N, g0, g1); return;
  }
}

}  // namespace

// x [M, K] float32 @ w.T for 4-bit w in lane layout, int8 activations (see the top of this file). Returns y [M, N]
// float32: out when given (a contiguous [M, N] float32 tensor), else a new tensor.
torch::Tensor lane_q8_gemm(torch::Tensor x, torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml,
                           c10::optional<torch::Tensor> out) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.size(1) % kBlock == 0,
              "x must be [M, K] float32 with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(lanes.is_contiguous() && lanes.dim() == 6 && lanes.size(1) == nb && lanes.size(2) == 8 &&
              lanes.size(3) == 8 && lanes.size(4) == 8 && lanes.size(5) == 2 && lanes.element_size() == 1,
              "lanes must be [N/64, K/32, 8, 8, 8, 2] bytes (4-bit lane layout)");
  const int64_t N = lanes.size(0) * 64, tiles = lanes.size(0);
  TORCH_CHECK(dl.is_contiguous() && dl.dtype() == torch::kFloat16 && dl.numel() == N * nb &&
              ml.is_contiguous() && ml.dtype() == torch::kFloat16 && ml.numel() == N * nb,
              "dl and ml must be [N/64, K/32, 8, 8] float16");
  auto y = leanserve::output_rows(out, M, N, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * nb), xs(M * nb);
  quantize_q8(xc.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
  const auto* wl = static_cast<const uint8_t*>(lanes.data_ptr());
  const auto* d = reinterpret_cast<const uint16_t*>(dl.data_ptr<at::Half>());
  const auto* m = reinterpret_cast<const uint16_t*>(ml.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // A task: one tile of 64 outputs (its weights stay in cache) for an m-block of at most kRowsPerTask rows, walked
  // in register tiles of at most kTileRows rows of equal size; halves of a tile when the task count does not
  // divide among the threads.
  const int64_t mblocks = (M + kRowsPerTask - 1) / kRowsPerTask, mrows = (M + mblocks - 1) / mblocks;
  const int64_t threads = at::get_num_threads();
  const int64_t halves = threads > 1 && (mblocks * tiles) % threads ? 2 : 1, per_mb = tiles * halves;
  const int64_t tile_bytes = nb * 8 * kBlockBytes, tile_scales = nb * 64;
  leanserve::SpinPool::parallel_for(mblocks * per_mb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task / per_mb, t = task % per_mb / halves, h = task % halves;
      const int g0 = static_cast<int>(h * 8 / halves), g1 = static_cast<int>((h + 1) * 8 / halves);
      const int64_t m_begin = mb * mrows, m_end = std::min(M, m_begin + mrows);
      const int64_t passes = (m_end - m_begin + kTileRows - 1) / kTileRows;
      thread_local std::vector<Chunk> chunks;
      chunks.resize((g1 - g0) * nb * 8);
      uint8_t* u = chunks.data()->bytes;
      unpack_tile(wl + t * tile_bytes, nb, g0, g1, u);
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t m0 = m_begin + (m_end - m_begin) * i / passes;
        const int64_t m1 = m_begin + (m_end - m_begin) * (i + 1) / passes;
        q8_rows(m1 - m0, u, d + t * tile_scales, m + t * tile_scales, nb, xq.data() + m0 * K,
                dx.data() + m0 * nb, xs.data() + m0 * nb, K, yp + m0 * N + t * 64, N, g0, g1);
      }
    }
  });
  return y;
}

// The instruction set lane_q8_gemm runs on in this build: "avx512_vnni" or "avx_vnni" (vpdpbusd), "avx2"
// (vpmaddubsw), or "scalar".
std::string lane_q8_gemm_isa() {
#if defined(LS_Q8_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(LS_Q8_AVX2) && defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(LS_Q8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}
