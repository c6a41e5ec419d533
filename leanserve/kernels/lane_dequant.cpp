// Prefill products with lane-layout GGUF weights through bf16: the weight is dequantized (exactly, in fp32, then
// rounded to bf16) into a pair-packed scratch buffer, and a bf16 GEMM with fp32 accumulation and output runs on it.
// For prefill chunks, where the lane kernel (int16 activations, block_quant_gemm.cpp) is compute-bound and a bf16
// dot-product instruction (AVX512_BF16 vdpbf16ps: 32 multiply-adds per instruction) does the same work in a
// fraction of the time. torch's bf16 matmul on CPU (oneDNN) returns bf16 only (``mm(..., out=float32)`` is refused
// and ``mkldnn.matmul.fp32_precision = "bf16"`` was not faster), which would round every output to 8 bits: hence
// this kernel, whose output is fp32.
//
// Pair-packed layout (vdpbf16ps's operand order): w [N, K] as [N / 16, K / 2, 16, 2] bf16, element (n, k) at
//   ((n / 16) * (K / 2) + k / 2) * 32 + (n % 16) * 2 + k % 2,
// so one 64-byte load holds the pair (k, k + 1) of 16 consecutive outputs.
//
// lane_dequant_bf16(lanes, dl, ml, bits, hi, lo): w from the lane layout (see block_quant_gemm.cpp), computed as
// block_dequantize does (4-bit: d * q + m, 8-bit: q * d, in fp32), written as hi = bf16(w) (round to nearest even)
// and, when lo is non-empty, lo = bf16(w - hi) (then hi + lo carries 16 significant bits of w).
//
// bf16_gemm(x, hi, lo, N, engine, out) -> y [M, N] float32 (out when given: output_rows, out_rows.h), on the
// avx512_bf16 engine (below) or the AMX one (amx_gemm.cpp): y[m, n] = sum over k of xh[m, k] * wh[n, k],
// xh = bf16(x); with lo
// ("bf16x3", after the split-precision schemes of e.g. Henry et al., "Leveraging the bfloat16 artificial
// intelligence datatype for higher-precision computations", 2019): x = xh + xl as w = wh + wl, and
// y = sum xh * wh + xh * wl + xl * wh (the xl * wl term, ~2**-16 relative, dropped), three times the products.
// Every output is one fp32 accumulator that adds the pairs of k in order (k = 0, 1, then 2, 3, ...; per pair the
// three products of bf16x3 in the order above): the same instructions for a row whatever M and the row's place in
// the call, so a row's result is bitwise independent of the other rows.
#include <torch/extension.h>
#include "amx_gemm.h"
#include "out_rows.h"
#include "spin_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LS_BF16_SIMD 1
#endif

namespace {

constexpr int64_t kBlock = 32;

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline uint16_t to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even
inline float from_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 16 consecutive values w[0..15] (fp32) -> hi (and lo) at the given 16 bf16 slots.
inline void store16(const float* w, uint16_t* hi, uint16_t* lo) {
#ifdef LS_BF16_SIMD
  const __m512 v = _mm512_loadu_ps(w);
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), reinterpret_cast<const __m256i&>(h));
  if (lo != nullptr) {
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<const __m256i&>(l));
  }
#else
  for (int j = 0; j < 16; ++j) {
    hi[j] = to_bf16(w[j]);
    if (lo != nullptr) lo[j] = to_bf16(w[j] - from_bf16(hi[j]));
  }
#endif
}

// Dequantizes tile t (64 outputs) of a lane-layout matrix into the pair-packed hi (and lo).
template <int kBits>
void dequant_tile(const uint8_t* lanes, const uint16_t* dl, const uint16_t* ml, int64_t nb, int64_t t, uint16_t* hi,
                  uint16_t* lo) {
  constexpr int64_t kPairs = kBits == 4 ? 8 : 16;     // 16-byte chunks per (block, group)
  constexpr int64_t kBlockBytes = kPairs * 16;
  const int64_t half_k = nb * 16;                      // K / 2: pairs per panel row
  const uint8_t* wl = lanes + t * nb * 8 * kBlockBytes;
  const uint16_t* dt = dl + t * nb * 64;
  const uint16_t* mt = kBits == 4 ? ml + t * nb * 64 : nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t g = 0; g < 8; ++g) {
      // scales of the group's 8 outputs, each twice (the layout's (lane, i) order)
      float dv[16], mv[16];
      for (int l = 0; l < 8; ++l) {
        dv[2 * l] = dv[2 * l + 1] = half_to_float(dt[b * 64 + g * 8 + l]);
        mv[2 * l] = mv[2 * l + 1] = kBits == 4 ? half_to_float(mt[b * 64 + g * 8 + l]) : 0.f;
      }
      const int64_t panel = 4 * t + g / 2, sub = 16 * (g % 2);
      const uint8_t* wb = wl + (b * 8 + g) * kBlockBytes;
      for (int64_t p = 0; p < kPairs; ++p) {
        const uint8_t* raw = wb + p * 16;
        float w0[16], w1[16];
#ifdef LS_BF16_SIMD
        const __m512 d = _mm512_loadu_ps(dv);
        if constexpr (kBits == 4) {
          const __m512 m = _mm512_loadu_ps(mv);
          const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw)));
          const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
          const __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
          _mm512_storeu_ps(w0, _mm512_add_ps(_mm512_mul_ps(d, ql), m));  // d * q + m, as block_dequantize
          _mm512_storeu_ps(w1, _mm512_add_ps(_mm512_mul_ps(d, qh), m));
        } else {
          const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw)));
          _mm512_storeu_ps(w0, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));  // q * d, as block_dequantize
        }
#else
        for (int j = 0; j < 16; ++j) {
          if constexpr (kBits == 4) {
            w0[j] = dv[j] * static_cast<float>(raw[j] & 0x0F) + mv[j];
            w1[j] = dv[j] * static_cast<float>(raw[j] >> 4) + mv[j];
          } else {
            w0[j] = static_cast<float>(static_cast<int8_t>(raw[j])) * dv[j];
          }
        }
#endif
        // low nibbles (or the 8-bit codes): pair 16 b + p; high nibbles: pair 16 b + 8 + p
        const int64_t at0 = (panel * half_k + 16 * b + p) * 32 + sub;
        store16(w0, hi + at0, lo != nullptr ? lo + at0 : nullptr);
        if constexpr (kBits == 4) {
          const int64_t at1 = (panel * half_k + 16 * b + 8 + p) * 32 + sub;
          store16(w1, hi + at1, lo != nullptr ? lo + at1 : nullptr);
        }
      }
    }
  }
}

// x [M, K] fp32 -> xh (and xl) [M, K] bf16, row-major.
void split_rows(const float* x, int64_t M, int64_t K, uint16_t* xh, uint16_t* xl) {
  leanserve::SpinPool::parallel_for(M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * K; i < end * K; i += 16) store16(x + i, xh + i, xl != nullptr ? xl + i : nullptr);
  }, /*spin=*/false);
}

// Register tile: R rows x 16 C outputs (C consecutive panels of 16 outputs at stride K * 16), all K. x rows at
// stride K (bf16), y rows at stride N.
template <int R, int C, bool kX3>
inline void tile(const uint16_t* xh, const uint16_t* xl, int64_t K, const uint16_t* wh, const uint16_t* wl, float* y,
                 int64_t N) {
  const int64_t pairs = K / 2, stride = K * 16;
#ifdef LS_BF16_SIMD
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh a[C], b[C];
    for (int c = 0; c < C; ++c) {
      a[c] = (__m512bh)_mm512_loadu_si512(wh + c * stride + kp * 32);
      if constexpr (kX3) b[c] = (__m512bh)_mm512_loadu_si512(wl + c * stride + kp * 32);
    }
    for (int r = 0; r < R; ++r) {
      int32_t ph;
      std::memcpy(&ph, xh + r * K + 2 * kp, 4);
      const __m512bh vh = (__m512bh)_mm512_set1_epi32(ph);
      if constexpr (kX3) {
        int32_t pl;
        std::memcpy(&pl, xl + r * K + 2 * kp, 4);
        const __m512bh vl = (__m512bh)_mm512_set1_epi32(pl);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][c], vh, a[c]), vh, b[c]), vl, a[c]);
      } else {
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vh, a[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + r * N + 16 * c, acc[r][c]);
#else
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < 16 * C; ++o) {
      const uint16_t* ph = wh + (o / 16) * stride + (o % 16) * 2;
      const uint16_t* pl = kX3 ? wl + (o / 16) * stride + (o % 16) * 2 : nullptr;
      float acc = 0.f;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        for (int i = 0; i < 2; ++i) {
          const float xv = from_bf16(xh[r * K + 2 * kp + i]);
          acc += xv * from_bf16(ph[kp * 32 + i]);
          if constexpr (kX3) {
            acc += xv * from_bf16(pl[kp * 32 + i]);
            acc += from_bf16(xl[r * K + 2 * kp + i]) * from_bf16(ph[kp * 32 + i]);
          }
        }
      }
      y[r * N + o] = acc;
    }
  }
#endif
}

// Register tile: 6 rows x 64 outputs (24 fp32 accumulators; per pair of k, 4 weight loads and 6 broadcasts for 24
// vdpbf16ps). 12 x 32 gave the same results (the arithmetic of a row does not depend on the tile) and measured
// slightly slower on Zen 5.
constexpr int kTileC = 4;                 // panels of 16 outputs per register tile
constexpr int64_t kTileR = 6;             // rows per register tile
constexpr int64_t kRowsPerTask = 96;      // rows of a task (a multiple of kTileR): their bf16 x stays in L2

template <int R, bool kX3>
inline void tile_at(const uint16_t* xh, const uint16_t* xl, int64_t K, const uint16_t* wh, const uint16_t* wl,
                    float* y, int64_t N) {
  tile<R, kTileC, kX3>(xh, xl, K, wh, wl, y, N);
}

template <bool kX3>
void gemm_impl(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const uint16_t* wh, const uint16_t* wl,
               int64_t N, float* y) {
  const int64_t cols = N / (16 * kTileC), mblocks = (M + kRowsPerTask - 1) / kRowsPerTask;
  // a task: 16 C outputs (C panels, streamed from L2) for one block of rows; tasks ordered row block first
  leanserve::SpinPool::parallel_for(mblocks * cols, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task / cols, j = task % cols;
      const int64_t at = j * kTileC * K * 16;
      const uint16_t* wt = wh + at;
      const uint16_t* wlt = kX3 ? wl + at : nullptr;
      const int64_t m_end = std::min(M, (mb + 1) * kRowsPerTask);
      for (int64_t m0 = mb * kRowsPerTask; m0 < m_end; m0 += kTileR) {
        const uint16_t* xt = xh + m0 * K;
        const uint16_t* xlt = kX3 ? xl + m0 * K : nullptr;
        float* yt = y + m0 * N + j * 16 * kTileC;
        switch (std::min<int64_t>(kTileR, m_end - m0)) {
#define LS_TILE(r) case r: if constexpr (r <= kTileR) tile_at<r, kX3>(xt, xlt, K, wt, wlt, yt, N); break;
          LS_TILE(12) LS_TILE(11) LS_TILE(10) LS_TILE(9) LS_TILE(8) LS_TILE(7)
          LS_TILE(6) LS_TILE(5) LS_TILE(4) LS_TILE(3) LS_TILE(2)
          default: tile_at<1, kX3>(xt, xlt, K, wt, wlt, yt, N); break;
#undef LS_TILE
        }
      }
    }
  }, /*spin=*/false);
}

uint16_t* bf16_ptr(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

// Whether this build has the AVX512_BF16 path (else both functions run their scalar reference loops: correct, slow).
bool bf16_gemm_simd() {
#ifdef LS_BF16_SIMD
  return true;
#else
  return false;
#endif
}

void lane_dequant_bf16(torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml, int64_t bits, torch::Tensor hi,
                       torch::Tensor lo) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(lanes.is_contiguous() && lanes.dim() == 6 && lanes.size(2) == 8 &&
              lanes.size(3) == (bits == 4 ? 8 : 16) && lanes.size(4) == 8 && lanes.size(5) == 2 &&
              lanes.element_size() == 1, "lanes must be [N/64, K/32, 8, 8 or 16, 8, 2] bytes");
  const int64_t tiles = lanes.size(0), nb = lanes.size(1), N = tiles * 64, K = nb * kBlock;
  TORCH_CHECK(dl.is_contiguous() && dl.dtype() == torch::kFloat16 && dl.numel() == N * nb,
              "dl must be [N/64, K/32, 8, 8] float16");
  TORCH_CHECK(bits == 8 || (ml.is_contiguous() && ml.dtype() == torch::kFloat16 && ml.numel() == N * nb),
              "ml must be [N/64, K/32, 8, 8] float16 for 4-bit weights");
  for (const auto* t : {&hi, &lo})
    TORCH_CHECK((t == &lo && t->numel() == 0) ||
                (t->dtype() == torch::kBFloat16 && t->is_contiguous() && t->numel() >= N * K),
                "hi (and lo unless empty) must be contiguous bfloat16 buffers of at least N * K elements");
  const auto* wl = static_cast<const uint8_t*>(lanes.data_ptr());
  const auto* d = reinterpret_cast<const uint16_t*>(dl.data_ptr<at::Half>());
  const auto* m = bits == 4 ? reinterpret_cast<const uint16_t*>(ml.data_ptr<at::Half>()) : nullptr;
  uint16_t* h = bf16_ptr(hi);
  uint16_t* l = lo.numel() ? bf16_ptr(lo) : nullptr;
  leanserve::SpinPool::parallel_for(tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (bits == 4) dequant_tile<4>(wl, d, m, nb, t, h, l);
      else dequant_tile<8>(wl, d, m, nb, t, h, l);
    }
  }, /*spin=*/false);
}

torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor hi, torch::Tensor lo, int64_t N, const std::string& engine,
                        c10::optional<torch::Tensor> out) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && N % 64 == 0 && N > 0, "K must be a multiple of 32 and N of 64");
  for (const auto* t : {&hi, &lo})
    TORCH_CHECK((t == &lo && t->numel() == 0) ||
                (t->dtype() == torch::kBFloat16 && t->is_contiguous() && t->numel() >= N * K),
                "hi (and lo unless empty) must be contiguous bfloat16 buffers of at least N * K elements");
  const bool amx = engine == "amx" || engine == "amx_emulated";
  TORCH_CHECK(amx || engine == "avx512_bf16", "engine must be avx512_bf16, amx or amx_emulated, not ", engine);
  TORCH_CHECK(engine != "amx" || leanserve::amx_bf16_status() == "ready",
              "the AMX engine cannot run in this process: ", leanserve::amx_bf16_status());
  auto y = leanserve::output_rows(out, M, N, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  const bool x3 = lo.numel() > 0;
  // the AMX engine reads whole blocks of rows: x's bf16 copies get zero rows up to the block
  const int64_t block = amx ? leanserve::amx_row_block(x3) : 1, rows = (M + block - 1) / block * block;
  auto xh = torch::empty({rows, K}, x.options().dtype(torch::kBFloat16));
  auto xl = x3 ? torch::empty({rows, K}, x.options().dtype(torch::kBFloat16)) : torch::Tensor();
  split_rows(xc.data_ptr<float>(), M, K, bf16_ptr(xh), x3 ? bf16_ptr(xl) : nullptr);
  if (rows > M) {
    xh.narrow(0, M, rows - M).zero_();
    if (x3) xl.narrow(0, M, rows - M).zero_();
  }
  if (amx)
    leanserve::amx_bf16_gemm(bf16_ptr(xh), x3 ? bf16_ptr(xl) : nullptr, M, K, bf16_ptr(hi),
                             x3 ? bf16_ptr(lo) : nullptr, N, y.data_ptr<float>(), engine == "amx_emulated");
  else if (x3) gemm_impl<true>(bf16_ptr(xh), bf16_ptr(xl), M, K, bf16_ptr(hi), bf16_ptr(lo), N, y.data_ptr<float>());
  else gemm_impl<false>(bf16_ptr(xh), nullptr, M, K, bf16_ptr(hi), nullptr, N, y.data_ptr<float>());
  return y;
}

std::string amx_bf16_status() { return leanserve::amx_bf16_status(); }
