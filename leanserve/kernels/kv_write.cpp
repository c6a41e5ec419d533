// write_kv_: a layer's new keys and values stored in its paged KV cache through the slot mapping, in one call (the
// CPU path of leanserve.model.attention.write_kv; bitwise what index_copy_ of k.to(cache dtype) stores).
//
// write_kv_(k, v, k_cache, v_cache, slot_mapping):
//   k, v [T, kv_heads, head_dim] float32 on CPU, each head's head_dim elements contiguous (stride(2) == 1; any token
//   and head strides, e.g. the k and v columns of the fused qkv product); k_cache, v_cache [num_blocks, block_size,
//   kv_heads, head_dim] float32 or float16, contiguous, the same dtype; slot_mapping [T] int64,
//   block_id * block_size + offset of each token.
// Errors: c10::Error (RuntimeError in Python) on a shape, dtype or layout that does not match, or a slot outside
//   [0, num_blocks * block_size) (checked for all slots before anything is written).
#include <torch/extension.h>

#include "kv_write.h"

void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
               torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype() &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.device().is_cpu() &&
              v_cache.device().is_cpu() &&
              (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kFloat16),
              "caches must be [num_blocks, block_size, kv_heads, head_dim] float32 or float16, contiguous, on CPU");
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->dtype() == torch::kFloat32 && x->device().is_cpu() && x->size(1) == kv_heads &&
                x->size(2) == head_dim && x->stride(2) == 1,
                "k and v must be [T, kv_heads, head_dim] float32 on CPU with contiguous heads, matching the cache");
  TORCH_CHECK(v.size(0) == k.size(0), "k and v must have the same number of tokens");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == k.size(0),
              "slot_mapping must be [T] int64");
  const int64_t n = k.size(0);
  if (n == 0) return;
  auto slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " out of range [0, ", slots_total, ")");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (k_cache.dtype() == torch::kFloat32)
    leanserve::write_kv_rows(kp, vp, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, n, kv_heads, head_dim,
                             k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots_total);
  else
    leanserve::write_kv_rows(kp, vp, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, n, kv_heads, head_dim,
                             k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), slots_total);
}
