// Fused per-token elementwise work of a Llama layer on CPU, float32: one pass over each row instead of the 6-8 torch
// ops (and temporaries) of the eager formulas. Each row is computed on its own, so a token's result never depends on
// the other rows of the batch.
//
// add_rms_norm_(x, y, w, eps):  x += y (in place, y may be empty), then returns w * x / sqrt(mean(x^2) + eps)
//                                (RMSNorm, Zhang & Sennrich 2019, as HF's LlamaRMSNorm computes it in fp32).
//                                x, y: [T, H] float32 contiguous; w: [H] float32.
// rope_(qkv, cos, sin, q_heads, k_heads, head_dim): rotary embedding, HF's "rotate half" layout, in place on the
//                                first (q_heads + k_heads) heads of each row of qkv [T, >= (q_heads + k_heads) * D]
//                                (the fused q|k|v projection output); cos, sin: [T, D] float32.
//                                x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2 (Su et al. 2021).
// silu_mul(gu) -> [T, I]:        SwiGLU's activation (Shazeer 2020), silu(gate) * up, of the fused gate|up
//                                projection output gu [T, 2 I] (gate = columns [0, I), up = [I, 2 I)), float32
//                                contiguous; silu(g) = g * sigmoid(g) with sigmoid(g) = 1 / (1 + e) for g >= 0 and
//                                e / (1 + e) for g < 0, e = exp(-|g|) (simd_exp.h's exp, ~2 ulp; the division
//                                exact). Every element runs the same lane arithmetic (16 or 8 lanes; a row's tail
//                                through a padded copy), so a value's result depends on nothing but its inputs and
//                                is the same on every AVX2 or AVX-512 build (scalar builds: std::exp); relative
//                                error to the exact function ~4 ulp (ATen's silu: ~1-2). One pass instead of
//                                ATen's silu, its temporary and mul.
#include <torch/extension.h>
#include "simd_exp.h"
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 && x.is_contiguous() &&
              w.is_contiguous() && x.dim() == 2 && w.numel() == x.size(1), "x [T, H], w [H]: float32 contiguous");
  const bool add = y.numel() > 0;
  TORCH_CHECK(!add || (y.dtype() == torch::kFloat32 && y.is_contiguous() && y.sizes() == x.sizes()),
              "y must be empty or like x");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* yp = add ? y.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  leanserve::SpinPool::parallel_for(T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * H;
      float ss = 0.f;
      if (add) {
        const float* yr = yp + t * H;
        for (int64_t j = 0; j < H; ++j) {
          xr[j] += yr[j];
          ss += xr[j] * xr[j];
        }
      } else {
        for (int64_t j = 0; j < H; ++j) ss += xr[j] * xr[j];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
      float* orow = op + t * H;
      for (int64_t j = 0; j < H; ++j) orow[j] = wp[j] * (xr[j] * inv);
    }
  }, /*spin=*/false);
  return out;
}

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t q_heads, int64_t k_heads,
           int64_t head_dim) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "float32 only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
              head_dim % 2 == 0 && qkv.size(1) >= (q_heads + k_heads) * head_dim, "shape mismatch");
  const int64_t T = qkv.size(0), row = qkv.stride(0), half = head_dim / 2, heads = q_heads + k_heads;
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  leanserve::SpinPool::parallel_for(T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * row + h * head_dim;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] - x2 * s[j];
          x[j + half] = x2 * c[j + half] + x1 * s[j + half];
        }
      }
    }
  }, /*spin=*/false);
}

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// lanes of silu(g) * u (see the top of the file): the same arithmetic lane for lane as the AVX2 variant below
inline Vec silu_mul_vec(Vec g, Vec u) {
  const Vec one = _mm512_set1_ps(1.f);
  const Vec e = leanserve::exp_nonpos(_mm512_castsi512_ps(  // exp(-|g|)
      _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  const __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(g), _mm512_setzero_si512());  // sign bit set
  const Vec num = _mm512_mask_blend_ps(neg, one, e);
  return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))), u);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec silu_mul_vec(Vec g, Vec u) {
  const Vec one = _mm256_set1_ps(1.f);
  const Vec e = leanserve::exp_nonpos(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // exp(-|g|)
  const Vec num = _mm256_blendv_ps(one, e, g);  // sign bit of g set: e, else 1
  return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))), u);
}
#endif

// One row: out[j] = silu(g[j]) * u[j], j < I.
void silu_mul_row(const float* g, const float* u, float* out, int64_t I) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t j = 0;
  for (; j + kLanes <= I; j += kLanes) vstore(out + j, silu_mul_vec(vload(g + j), vload(u + j)));
  if (j < I) {  // the tail through a padded copy: the same arithmetic as the full vectors
    float gt[kLanes] = {}, ut[kLanes] = {}, ot[kLanes];
    std::memcpy(gt, g + j, (I - j) * sizeof(float));
    std::memcpy(ut, u + j, (I - j) * sizeof(float));
    vstore(ot, silu_mul_vec(vload(gt), vload(ut)));
    std::memcpy(out + j, ot, (I - j) * sizeof(float));
  }
#else
  for (int64_t j = 0; j < I; ++j) {
    const float e = std::exp(-std::fabs(g[j]));
    out[j] = g[j] * ((g[j] < 0.f ? e : 1.f) / (1.f + e)) * u[j];
  }
#endif
}

}  // namespace

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dtype() == torch::kFloat32 && gu.is_contiguous() && gu.dim() == 2 && gu.size(1) % 2 == 0,
              "silu_mul: gu [T, 2 I] float32 contiguous");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
  };
  if (T * I < (1 << 15)) {  // a decode step's few rows: cheaper than waking the pool
    rows(0, T);
  } else {
    // spin: the down projection's kernel, on the same pool, follows
    leanserve::SpinPool::parallel_for(T, std::max<int64_t>(1, 4096 / std::max<int64_t>(I, 1)), rows,
                                      /*spin=*/true);
  }
  return out;
}
