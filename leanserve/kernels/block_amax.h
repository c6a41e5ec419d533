// One block of 32 activations loaded for quantization, and its largest magnitude: shared by the int16 quantizer of
// the lane / block kernels (block_quant_gemm.cpp) and the int8 one of lane_q8_gemm.cpp.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace leanserve {

// v[0..3] = xb[0..31] (8 floats each); returns max |xb[j]|.
inline float load_block_amax(const float* xb, __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 a = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
  a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
  return _mm_cvtss_f32(a4);
}

}  // namespace leanserve
#endif
