// Per-row helpers of the decode step on CPU, each one pass in one native call instead of several torch ops (and, for
// the argmax, instead of waking torch's OpenMP threads for a 200 KB reduction).
//
// argmax_rows(x) -> [n] int64:  x.argmax(-1) of x [n, m] float32 (m >= 1), as torch defines it: the first index of
//                               the maximum; a NaN counts as the maximum (the first NaN wins); +0 and -0 are equal.
//                               NaN is detected from the bits (the kernels build with -ffast-math, under which a
//                               float compare may assume no NaN). Rows run on the calling thread (a row of a 49k
//                               vocabulary is ~10 us: less than waking a pool thread).
// lane_gather_rows(lanes, dl, ml, bits, ids) -> (codes [T, K/32 * B] bytes, d [T, K/32] fp16, mn [T, K/32] fp16 or
//                               an empty fp16 tensor for 8 bits): the rows ``ids`` [T] int64 of a lane-layout
//                               BlockQuantWeight (leanserve/quantization/weights.py: lanes [N/64, K/32, 8, P, 8, 2]
//                               bytes with P = 8 (4-bit) or 16 (8-bit), dl / ml [N/64, K/32, 8, 8] fp16; row r is
//                               tile r / 64, group r / 8 % 8, lane r % 8) in the file (GGUF block) layout that
//                               block_dequantize reads: B = 2 P bytes per 32-value block. An embedding lookup.
// Errors: c10::Error (RuntimeError in Python) on a shape or dtype that does not match, or an id out of [0, N).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline uint32_t float_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// The first index of row x [m] holding its maximum (a NaN: the first NaN).
int64_t argmax_row(const float* x, int64_t m) {
  int64_t j = 0;
  float best = x[0];
  bool nan = false;
#if defined(__AVX2__)
  if (m >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vnan = _mm256_setzero_si256();
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; j + 8 <= m; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      vnan = _mm256_or_si256(vnan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf));
      vmax = _mm256_max_ps(vmax, v);
    }
    nan = !_mm256_testz_si256(vnan, vnan);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    best = lanes[0];
    for (int i = 1; i < 8; ++i) best = lanes[i] > best ? lanes[i] : best;
  }
#endif
  for (; j < m; ++j) {  // the tail (all of a row without AVX2)
    nan = nan || is_nan_bits(float_bits(x[j]));
    best = x[j] > best ? x[j] : best;
  }
  if (nan) {
    for (int64_t i = 0; i < m; ++i)
      if (is_nan_bits(float_bits(x[i]))) return i;
  }
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vb = _mm256_set1_ps(best);
  for (; i + 8 <= m; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vb, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; i < m; ++i)
    if (x[i] == best) return i;
  return 0;  // unreachable: best is one of the row's values
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.size(1) >= 1, "x must be [n, m >= 1] float32");
  auto xc = x.contiguous();
  const int64_t n = xc.size(0), m = xc.size(1);
  auto out = torch::empty({n}, torch::kInt64);
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) op[r] = argmax_row(xp + r * m, m);
  return out;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> lane_gather_rows(torch::Tensor lanes, torch::Tensor dl,
                                                                         torch::Tensor ml, int64_t bits,
                                                                         torch::Tensor ids) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t P = bits == 4 ? 8 : 16;
  TORCH_CHECK(lanes.dim() == 6 && lanes.is_contiguous() && lanes.element_size() == 1 && lanes.size(2) == 8 &&
              lanes.size(3) == P && lanes.size(4) == 8 && lanes.size(5) == 2,
              "lanes must be [N/64, K/32, 8, ", P, ", 8, 2] contiguous bytes");
  const int64_t tiles = lanes.size(0), nb = lanes.size(1), N = tiles * 64;
  TORCH_CHECK(dl.dtype() == torch::kFloat16 && dl.is_contiguous() && dl.dim() == 4 && dl.size(0) == tiles &&
              dl.size(1) == nb && dl.size(2) == 8 && dl.size(3) == 8, "dl must be [N/64, K/32, 8, 8] float16");
  const bool has_mn = bits == 4 && ml.numel() > 0;
  TORCH_CHECK(!has_mn || (ml.dtype() == torch::kFloat16 && ml.is_contiguous() && ml.sizes() == dl.sizes()),
              "ml must be empty or like dl");
  TORCH_CHECK(ids.dim() == 1 && ids.dtype() == torch::kInt64, "ids must be [T] int64");
  auto idc = ids.contiguous();
  const int64_t T = idc.size(0), B = 2 * P;
  auto codes = torch::empty({T, nb * B}, lanes.options());
  auto d = torch::empty({T, nb}, dl.options());
  auto mn = has_mn ? torch::empty({T, nb}, ml.options()) : torch::empty({0}, dl.options());
  const int64_t* id = idc.data_ptr<int64_t>();
  const auto* src = static_cast<const uint8_t*>(lanes.data_ptr());
  auto* dst = static_cast<uint8_t*>(codes.data_ptr());
  const auto* dsrc = static_cast<const uint16_t*>(dl.data_ptr());
  const auto* msrc = has_mn ? static_cast<const uint16_t*>(ml.data_ptr()) : nullptr;
  auto* ddst = static_cast<uint16_t*>(d.data_ptr());
  auto* mdst = has_mn ? static_cast<uint16_t*>(mn.data_ptr()) : nullptr;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t r = id[i];
    TORCH_CHECK(r >= 0 && r < N, "row id ", r, " out of [0, ", N, ")");
    const int64_t t = r / 64, g = r / 8 % 8, lane = r % 8;
    for (int64_t b = 0; b < nb; ++b) {
      // lanes[t, b, g, p, lane, :] for p in [0, P): 2 bytes each, 16 bytes apart
      const uint8_t* s = src + (((t * nb + b) * 8 + g) * P * 8 + lane) * 2;
      uint8_t* o = dst + (i * nb + b) * B;
      for (int64_t p = 0; p < P; ++p) std::memcpy(o + 2 * p, s + p * 16, 2);
      const int64_t si = ((t * nb + b) * 8 + g) * 8 + lane;
      ddst[i * nb + b] = dsrc[si];
      if (has_mn) mdst[i * nb + b] = msrc[si];
    }
  }
  return {codes, d, mn};
}
