// Matrix products with GGUF block-quantized weights kept in their file layout (ggml's Q4_1 / Q4_0 / Q8_0 blocks of
// 32 weights, split into a codes array and fp16 scale arrays), for small and large batches on CPU.
//
// y[m, n] = sum_k x[m, k] * w[n, k], w dequantized per block b of 32 inputs:
//   4-bit: w = d[n, b] * q + mn[n, b]      (q in 0..15; Q4_0 is stored with mn = -8 d, which is exact in fp16)
//   8-bit: w = d[n, b] * q                  (q in -128..127, Q8_0)
// Activations are quantized per row and block to int16 (dx = max|x| / 32767, relative error <= 2**-16 of the
// block's largest value, far below fp32 GEMM noise at these widths), so each block's dot product is an exact int32
// sum of int16 x 16-bit products (AVX2 vpmaddwd), scaled once per block in fp32:
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
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LS_AVX2 1
#endif

namespace {

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
        __m256 v[4], a = _mm256_setzero_ps(), sv = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 4; ++j) {
          v[j] = _mm256_loadu_ps(xb + 8 * j);
          a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
          sv = _mm256_add_ps(sv, v[j]);
        }
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
        const float amax_v = _mm_cvtss_f32(a4);
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

}  // namespace

torch::Tensor block_quant_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor mn,
                               int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == (bits == 4 ? K / 2 : K) &&
              codes.element_size() == 1, "codes must be [N, K/2] uint8 (4-bit) or [N, K] int8 (8-bit)");
  TORCH_CHECK(d.is_contiguous() && d.dtype() == torch::kFloat16 && d.size(0) == N && d.size(1) == nb,
              "d must be [N, K/32] float16");
  TORCH_CHECK(bits == 8 || (mn.is_contiguous() && mn.dtype() == torch::kFloat16 && mn.sizes() == d.sizes()),
              "mn must be [N, K/32] float16");
  auto xc = x.contiguous();
  std::vector<int16_t> xq(M * K);
  std::vector<float> dx(M * nb), xs(M * nb);
  quantize_activations(xc.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
  auto y = torch::empty({M, N}, x.options());
  const auto* wq = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  if (bits == 4) {
    const auto* wm = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
    gemm<4>(xq.data(), dx.data(), xs.data(), M, K, wq, wd, wm, N, y.data_ptr<float>());
  } else {
    gemm<8>(xq.data(), dx.data(), xs.data(), M, K, wq, wd, nullptr, N, y.data_ptr<float>());
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
