// Float32 matrix product for a few rows: y = x @ w.T, x [T, K] (T <= 8), w [N, K], both float32, contiguous.
//
// Why: a decode step multiplies one row per sequence by every weight matrix, and speculative verification a few
// rows (1 + k per sequence). OpenBLAS's sgemv streams the weights at the memory's speed for one row, but its sgemm
// for 2-8 rows is several times slower than that one gemv on the CPUs measured (it packs panels meant for large
// products), so verifying 4 drafts against a float32 model cost ~5 plain decode steps. This kernel reads each
// weight row once for all T input rows, so T <= 8 rows cost about what one row does when the weights come from
// memory (given the software prefetch in block(): README, CPU kernels).
//
// Numerics: every output y[t, n] is one fused multiply-add chain over k in vector steps of the ISA's width (16
// floats on AVX-512, 8 on AVX2; the last partial step zero-masked), then a fixed-order horizontal sum: the same
// operations whatever T is, however the rows of w are split between threads, so a row's result is bitwise
// independent of the other rows in the product (a verified token's logits equal those of its plain decode). It
// differs from BLAS in the last bits (another summation order).
#include <torch/extension.h>
#include "spin_pool.h"

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;

// One ISA's vector operations for block(): a register of kWidth floats, a load of the first n < kWidth floats
// (the rest zero), and the fixed-order horizontal sum.
#if defined(__AVX512F__)
struct Isa {
  using Vec = __m512;
  static constexpr int64_t kWidth = 16;
  struct Tail {
    __mmask16 mask;
    explicit Tail(int64_t n) : mask(static_cast<__mmask16>((1u << n) - 1u)) {}
  };
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(const float* p, const Tail& t) { return _mm512_maskz_loadu_ps(t.mask, p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa {
  using Vec = __m256;
  static constexpr int64_t kWidth = 8;
  struct Tail {
    __m256i mask;
    explicit Tail(int64_t n) {
      alignas(32) int32_t bits[8];
      for (int i = 0; i < 8; ++i) bits[i] = i < n ? -1 : 0;
      mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
    }
  };
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_tail(const float* p, const Tail& t) { return _mm256_maskload_ps(p, t.mask); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(Vec v) {  // fixed order: (lo + hi) pairwise
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Rows [n0, n1) of y for T input rows, R weight rows at a time (T * R accumulators). With PF > 0 every vector step
// also prefetches the same offset of the rows PF groups ahead (rows are contiguous, so PF * R rows further on):
// with T >= 2 rows the arithmetic per weight byte grows and the hardware prefetcher alone no longer keeps enough
// loads in flight when the weights come from DRAM (measured: benchmarks/f32_decode.py, README). A prefetch changes
// no arithmetic, and past the matrix's end it is a hint that touches nothing.
template <int T, int R, int PF>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  using V = Isa::Vec;
  const int64_t full = K / Isa::kWidth * Isa::kWidth;
  const Isa::Tail tail(K - full);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    V acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = Isa::zero();
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + n * K) + static_cast<uintptr_t>(PF * R * K) * sizeof(float);
    for (int64_t k = 0; k < full; k += Isa::kWidth) {
      V wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Isa::load(w + (n + r) * K + k);
      if constexpr (PF > 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + static_cast<uintptr_t>(r * K + k) * sizeof(float)),
                       _MM_HINT_T0);
      for (int t = 0; t < T; ++t) {
        const V xv = Isa::load(x + t * K + k);
        for (int r = 0; r < R; ++r) acc[t][r] = Isa::fmadd(xv, wv[r], acc[t][r]);
      }
    }
    if (full < K) {
      V wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Isa::load_tail(w + (n + r) * K + full, tail);
      for (int t = 0; t < T; ++t) {
        const V xv = Isa::load_tail(x + t * K + full, tail);
        for (int r = 0; r < R; ++r) acc[t][r] = Isa::fmadd(xv, wv[r], acc[t][r]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) y[t * N + n + r] = Isa::hsum(acc[t][r]);
  }
  if (n < n1) block<T, 1, PF>(x, w, y, K, N, n, n1);  // the last rows, one at a time (same chain per output)
}

#else
template <int T, int R, int PF>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int t = 0; t < T; ++t) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[t * K + k] * w[n * K + k];
      y[t * N + n] = s;
    }
}
#endif

// Weight rows per accumulator group (T * R accumulators plus R weights and one x must fit the 32 zmm / 16 ymm
// registers) and the prefetch distance in groups, per T: chosen by measuring every fitting (R, PF) over the default
// model's 120 float32 projection matrices streamed from DRAM, 1 and 2 threads (AMD EPYC Zen 5, AVX-512 and the AVX2
// build). One row on AVX-512 keeps the hardware prefetcher alone (it measured as fast).
#if defined(__AVX512F__)
template <int T>
constexpr int kGroup = T <= 3 ? 4 : (T == 4 ? 3 : (T == 5 ? 4 : (T <= 7 ? 3 : 2)));
template <int T>
constexpr int kAhead = T == 1 ? 0 : 1;
#else
template <int T>
constexpr int kGroup = T <= 2 ? 4 : 1;
template <int T>
constexpr int kAhead = T <= 2 ? 1 : 2;
#endif

template <int T>
void run(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  // Tasks of 32 weight rows (a multiple of every group size but 3: the remainder rows take the single-row path,
  // which computes the same chain per output).
  constexpr int64_t kRowsPerTask = 32;
  leanserve::SpinPool::parallel_for((N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    block<T, kGroup<T>, kAhead<T>>(x, w, y, K, N, begin * kRowsPerTask, std::min(N, end * kRowsPerTask));
  });
}

}  // namespace

// y [T, N] float32 = x [T, K] @ w [N, K].T for 1 <= T <= 8 (see the notes at the top of this file).
torch::Tensor f32_small_gemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "f32_small_gemm: x [T, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "f32_small_gemm: float32 tensors");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "f32_small_gemm: 1 to 8 rows");
  TORCH_CHECK(w.is_contiguous(), "f32_small_gemm: w must be contiguous");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (T) {
    case 1: run<1>(xp, wp, yp, K, N); break;
    case 2: run<2>(xp, wp, yp, K, N); break;
    case 3: run<3>(xp, wp, yp, K, N); break;
    case 4: run<4>(xp, wp, yp, K, N); break;
    case 5: run<5>(xp, wp, yp, K, N); break;
    case 6: run<6>(xp, wp, yp, K, N); break;
    case 7: run<7>(xp, wp, yp, K, N); break;
    default: run<8>(xp, wp, yp, K, N); break;
  }
  return y;
}
