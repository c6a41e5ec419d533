// Paged decode attention for CPU: one query token per sequence, keys/values read in place from the paged KV cache
// through each sequence's block table (no gather, no padding). Online softmax per block of tokens (Milakov &
// Gimelshein 2018, "Online normalizer calculation for softmax"; the flash-decoding split over sequences x KV heads).
//
// q:            [N, H, D] float32, contiguous (N sequences, H query heads)
// k/v_cache:    [num_blocks, block_size, KVH, D] float32, contiguous
// block_tables: [N, max_blocks] int64; seq_lens: [N] int64 (tokens to attend, the new one included)
// returns       [N, H, D] float32. The G = H / KVH query heads of a KV head share its keys (GQA).
#include <torch/extension.h>
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// kD, kG > 0: head size and query heads per KV head known at compile time (fully vectorized loops); 0: runtime.
template <int64_t kD, int64_t kG>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& bt_c, const torch::Tensor& sl_c, double scale, torch::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1);
  const int64_t D = kD > 0 ? kD : q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = kG > 0 ? kG : H / KVH, MB = bt_c.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = bt_c.data_ptr<int64_t>();
  const int64_t* sl = sl_c.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  int64_t total_len = 0;  // keys read per KV head, over all sequences: below ~2k the work is too small to share
  for (int64_t n = 0; n < N; ++n) total_len += sl[n];
  const int64_t grain = total_len >= 2048 ? 1 : N * KVH;
  leanserve::SpinPool::parallel_for(N * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * BS);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t n = idx / KVH, kh = idx % KVH;
      const float* qn = qp + (n * H + kh * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = sl[n];
      for (int64_t j = 0; j * BS < len; ++j) {
        const int64_t blk = bt[n * MB + j];
        const int64_t cnt = std::min(BS, len - j * BS);
        const float* kb = kp + (blk * BS * KVH + kh) * D;
        const float* vb = vp + (blk * BS * KVH + kh) * D;
        for (int64_t t = 0; t < cnt; ++t) {
          const float* kr = kb + t * KVH * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qn + g * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
            s[g * BS + t] = dot * sc;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * BS;
          float bmax = neg_inf;
          for (int64_t t = 0; t < cnt; ++t) bmax = std::max(bmax, sg[t]);
          const float new_m = std::max(m[g], bmax);
          const float c = std::exp(m[g] - new_m);  // 0 for the first block (m = -inf)
          float sum = 0.f;
          for (int64_t t = 0; t < cnt; ++t) {
            sg[t] = std::exp(sg[t] - new_m);
            sum += sg[t];
          }
          l[g] = l[g] * c + sum;
          m[g] = new_m;
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] *= c;
        }
        for (int64_t t = 0; t < cnt; ++t) {
          const float* vr = vb + t * KVH * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * BS + t];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
          }
        }
      }
      float* on = op + (n * H + kh * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) on[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 tables");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3) &&
              q.size(1) % k_cache.size(2) == 0 && block_tables.size(0) == q.size(0) &&
              seq_lens.size(0) == q.size(0), "shape mismatch");
  auto bt_c = block_tables.contiguous();
  auto sl_c = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t D = q.size(2), G = q.size(1) / k_cache.size(2);
  if (D == 64 && G == 3) decode_kernel<64, 3>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 64 && G == 4) decode_kernel<64, 4>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 128 && G == 4) decode_kernel<128, 4>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 128 && G == 8) decode_kernel<128, 8>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else decode_kernel<0, 0>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  return out;
}
