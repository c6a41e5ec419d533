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
#include <torch/extension.h>
#include "spin_pool.h"

#include <cmath>

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
