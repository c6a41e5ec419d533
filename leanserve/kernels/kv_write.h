// The paged KV cache write shared by write_kv_ (kv_write.cpp) and the fused decode (decode_layers.cpp): a step's new
// key and value rows stored in their cache slots through the slot mapping, converted to the cache's element type.
//
// write_kv_rows<T>(k, v, k_tok, k_head, v_tok, v_head, slots, n, kv_heads, head_dim, kc, vc, slots_total):
//   k, v: the first new row's keys / values (float32); row t's head h starts at k + t * k_tok + h * k_head (the
//   head_dim elements of a head contiguous); slots [n] int64; kc, vc: the caches, slot s's row at
//   kc + s * kv_heads * head_dim (T = float: copied; T = c10::Half: rounded to nearest even, as torch's
//   .to(torch.float16) on CPU: F16C's vcvtps2ph where the build has it, else c10::Half's conversion).
// Errors: c10::Error when a slot is outside [0, slots_total) (rows before it are already written, as index_copy_
//   checks all indices first: callers check ranges up front where a partial write matters).
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace leanserve {

inline void kv_row_store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void kv_row_store(c10::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
  auto* out = reinterpret_cast<uint16_t*>(dst);
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

template <typename T>
void write_kv_rows(const float* k, const float* v, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
                   const int64_t* slots, int64_t n, int64_t kv_heads, int64_t head_dim, T* kc, T* vc,
                   int64_t slots_total) {
  const int64_t row = kv_heads * head_dim;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= 0 && s < slots_total, "slot ", s, " out of range [0, ", slots_total, ")");
    T* kd = kc + s * row;
    T* vd = vc + s * row;
    const float* ks = k + t * k_tok;
    const float* vs = v + t * v_tok;
    if (k_head == head_dim && v_head == head_dim) {  // the row's heads are contiguous: one store per row
      kv_row_store(kd, ks, row);
      kv_row_store(vd, vs, row);
      continue;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      kv_row_store(kd + h * head_dim, ks + h * k_head, head_dim);
      kv_row_store(vd + h * head_dim, vs + h * v_head, head_dim);
    }
  }
}

}  // namespace leanserve
