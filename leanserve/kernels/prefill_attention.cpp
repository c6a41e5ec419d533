// Paged prefill attention for CPU: a prefill chunk's queries attend causally to their sequence's keys, read in
// place from the paged KV cache through the sequence's block table (no gather, no mask tensor).
//
// Algorithm: the forward pass of flash attention (Dao et al., NeurIPS 2022, "FlashAttention: Fast and
// Memory-Efficient Exact Attention with IO-Awareness", algorithm 1) with the online softmax (Milakov & Gimelshein
// 2018) in fp32. A task is one (KV head, tile of kTileQ query positions); its rows are the tile's queries of the
// G = H / KVH query heads that share the KV head (GQA), so every key block is reused by all kTileQ * G rows. Per
// cache block j of keys (block_size keys, one block at a time, in order): scores S = Q K_j^T (fp32
// accumulation), mask, running max m, p = exp(S - m), rescale of the running sum l and of the output accumulator,
// accumulator += P V_j; at the end out = acc / l. Tasks are taken heaviest first (the last
// query tiles see the most keys) from a shared counter by the SpinPool's threads, which balances the causal shape.
//
// Precision paths:
// * bf16 (builds with AVX512_BF16, asked by use_bf16): Q, K, P and V rounded to bf16 (round to nearest even),
//   products by vdpbf16ps with fp32 accumulation; scores, softmax, l and the accumulator in fp32.
// * fp32 (AVX-512 or AVX2 FMA, the Isa traits; scalar loops elsewhere): everything in fp32.
//
// Invariance: a query row's result is bitwise independent of the chunk it is in (length, start) and of whether
// its keys were written by this chunk or an earlier one: every row runs the same instructions over key blocks
// 0, 1, ..., up to the block holding its own position, in that order, whatever tile or row group it sits in. A
// block wholly beyond a row's position is skipped for that row; in the row's last block the keys beyond its
// position are masked to -inf (p = 0 exactly). Cache slots past the chunk's last token are zeroed in the packed
// copy, so P V never reads stale cache contents (0 * finite = 0 exactly).
//
// Memory: the blocks the chunk reads are converted once per call into a packed copy per KV head (contiguous, in
// the dot products' operand layout: fp32, or bf16 pairs), shared by all tasks of that head, so the scattered cache
// blocks are read once and each task streams its head's copy (512 KB per KV head at 2,048 keys in bf16).
//
// q:          [n, H, D] float32 (RoPE applied), each row's H * D values contiguous at any row stride (the q
//             columns of the fused qkv product); row i is at position context_len + i
// k/v_cache:  [num_blocks, block_size, KVH, D] float32, contiguous (this chunk's K/V already written)
// block_ids:  [>= ceil((context_len + n) / block_size)] int64, the sequence's block table
// out:        optional [n, H, D] float32 with contiguous rows (any row stride) to write into
// returns     [n, H, D] float32 (out when given)
// SIMD paths for D in {64, 128} and block_size a multiple of 16; other shapes run the scalar loops (same contract).
#include <torch/extension.h>
#include "amx_gemm.h"
#include "amx_tiles.h"
#include "simd_exp.h"
#include "spin_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LS_PREFILL_BF16 1
#endif

namespace {

constexpr int64_t kTileQ = 32;  // query positions per task
constexpr int64_t kRows = 8;    // rows whose scores are computed together (tile rows are padded to a multiple)

struct Args {
  const float* q;
  const float* kc;
  const float* vc;
  const int64_t* bt;
  float* out;
  int64_t n, H, KVH, G, D, BS, ctx;
  float scale;
  int64_t qs, os;  // row strides of q and out (floats)
  // head h of query row i, and of its output row
  const float* qrow(int64_t i, int64_t h) const { return q + i * qs + h * D; }
  float* orow(int64_t i, int64_t h) const { return out + i * os + h * D; }
};

// One call's packed K and V: block j of KV head kh at k + (kh * nblk + j) * ks (and v + ... * vs), in the worker's
// layout, written once per call by Worker::pack and read by every task of that KV head.
template <typename T>
struct Packed {
  const T* k;
  const T* v;
  int64_t nblk, ks, vs;
  const T* kblock(int64_t kh, int64_t j) const { return k + (kh * nblk + j) * ks; }
  const T* vblock(int64_t kh, int64_t j) const { return v + (kh * nblk + j) * vs; }
};

// Packs the keys the chunk reads (in parallel over (KV head, unit), a unit being Worker::unit keys: a cache block,
// or the AMX path's key step), then runs task(kv_head, first query row, query rows) for every (KV head, tile),
// heaviest tiles first, on the pool. The packed copy lives in buffers of the
// calling thread, kept between calls (grown to the longest sequence seen: 2 * its tokens * KVH * D elements).
template <class Worker>
void run_tasks(const Args& a) {
  using T = typename Worker::T;
  const int64_t unit = Worker::unit(a);  // keys per packed unit: a cache block, or the AMX path's key step
  const int64_t nblk = (a.ctx + a.n + unit - 1) / unit;
  const int64_t ks = Worker::k_size(a), vs = Worker::v_size(a);
  static thread_local std::vector<T> kbuf, vbuf;
  if (static_cast<int64_t>(kbuf.size()) < nblk * a.KVH * ks) kbuf.resize(nblk * a.KVH * ks);
  if (static_cast<int64_t>(vbuf.size()) < nblk * a.KVH * vs) vbuf.resize(nblk * a.KVH * vs);
  T* kb = kbuf.data();
  T* vb = vbuf.data();
  if (ks > 0) {
    leanserve::SpinPool::parallel_for(nblk * a.KVH, 8, [&](int64_t begin, int64_t end) {
      for (int64_t idx = begin; idx < end; ++idx)
        Worker::pack(a, idx % nblk, idx / nblk, kb + idx * ks, vb + idx * vs);
    });
  }
  const Packed<T> packed{kb, vb, nblk, ks, vs};
  const int64_t tiles = (a.n + kTileQ - 1) / kTileQ;
  const int64_t tasks = tiles * a.KVH;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  leanserve::SpinPool::parallel_for(threads, 1, [&](int64_t, int64_t) {
    Worker w(a, packed);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t tile = tiles - 1 - t / a.KVH, kh = t % a.KVH;
      const int64_t i0 = tile * kTileQ;
      w.task(kh, i0, std::min(kTileQ, a.n - i0));
    }
  });
}

// ------------------------------------------------------------------------------------------------ scalar loops
struct ScalarWorker {  // reads the cache directly (no packed copy)
  using T = float;
  static int64_t unit(const Args& a) { return a.BS; }
  static int64_t k_size(const Args&) { return 0; }
  static int64_t v_size(const Args&) { return 0; }
  static void pack(const Args&, int64_t, int64_t, float*, float*) {}
  const Args& a;
  std::vector<float> s, acc, m, l;
  ScalarWorker(const Args& args, const Packed<float>&)
      : a(args), s(args.BS), acc(kTileQ * args.G * args.D), m(kTileQ * args.G), l(kTileQ * args.G) {}

  void task(int64_t kh, int64_t i0, int64_t nq) {
    const int64_t G = a.G, D = a.D, BS = a.BS, rows = nq * G, row = a.KVH * D;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
    std::fill(m.begin(), m.begin() + rows, neg_inf);
    std::fill(l.begin(), l.begin() + rows, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / G, g = r % G, pos = a.ctx + i0 + i;
      const float* qr = a.qrow(i0 + i, kh * G + g);
      float* ar = acc.data() + r * D;
      for (int64_t j = 0; j * BS <= pos; ++j) {
        const int64_t valid = std::min(BS, pos - j * BS + 1);
        const float* kb = a.kc + (a.bt[j] * BS * a.KVH + kh) * D;
        const float* vb = a.vc + (a.bt[j] * BS * a.KVH + kh) * D;
        float bmax = neg_inf;
        for (int64_t t = 0; t < valid; ++t) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kb[t * row + d];
          s[t] = dot * a.scale;
          bmax = std::max(bmax, s[t]);
        }
        const float new_m = std::max(m[r], bmax);
        const float c = m[r] == neg_inf ? 0.f : std::exp(m[r] - new_m);
        float sum = 0.f;
        for (int64_t t = 0; t < valid; ++t) {
          s[t] = std::exp(s[t] - new_m);
          sum += s[t];
        }
        l[r] = l[r] * c + sum;
        m[r] = new_m;
        for (int64_t d = 0; d < D; ++d) ar[d] *= c;
        for (int64_t t = 0; t < valid; ++t)
          for (int64_t d = 0; d < D; ++d) ar[d] += s[t] * vb[t * row + d];
      }
      float* o = a.orow(i0 + i, kh * G + g);
      for (int64_t d = 0; d < D; ++d) o[d] = ar[d] / l[r];
    }
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// ------------------------------------------------------------------------------------------------ ISA traits
#if defined(__AVX512F__)
struct Isa {
  using Vec = __m512;
  static constexpr int64_t kWidth = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static float hmax(Vec v) { return _mm512_reduce_max_ps(v); }
  static float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
  static Vec mask_from(Vec v, int64_t valid) {  // lanes >= valid (0 <= valid) set to -inf
    const __mmask16 keep = valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << std::max<int64_t>(valid, 0)) - 1u);
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), v);
  }
  static Vec exp_nonpos(Vec x) { return leanserve::exp_nonpos(x); }  // simd_exp.h: ~2 ulp, 0 below -87.3
};
#else
struct Isa {
  using Vec = __m256;
  static constexpr int64_t kWidth = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static float hmax(Vec v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
  }
  static float hsum(Vec v) {  // fixed order: (lo + hi) pairwise
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static Vec mask_from(Vec v, int64_t valid) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(
        std::min<int64_t>(valid, 8))), idx));
    return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), v, keep);
  }
  static Vec exp_nonpos(Vec x) { return leanserve::exp_nonpos(x); }  // simd_exp.h
};
#endif

using Vec = Isa::Vec;
constexpr int64_t W = Isa::kWidth;

// The online-softmax step of one row for one block: s [BS] holds the row's raw dot products; on return s holds
// p = exp(scale * dot - new_m) (0 for the keys at index >= valid), m and the row's running sum (lv: W lanes, summed
// once at the end) are updated, and the accumulator's rescale factor is returned (exactly 1 when the maximum did
// not change). The same instructions for every row.
inline float softmax_step(float* s, int64_t BS, int64_t valid, float scale, float& m, float* lv) {
  const Vec sc = Isa::set1(scale);
  Vec mx = Isa::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < BS; t += W) {
    const Vec v = Isa::mask_from(Isa::mul(Isa::load(s + t), sc), valid - t);
    Isa::store(s + t, v);
    mx = Isa::max(mx, v);
  }
  const float new_m = std::max(m, Isa::hmax(mx));
  const Vec nm = Isa::set1(new_m);
  Vec sum = Isa::zero();
  for (int64_t t = 0; t < BS; t += W) {
    const Vec e = Isa::exp_nonpos(Isa::sub(Isa::load(s + t), nm));
    Isa::store(s + t, e);
    sum = Isa::add(sum, e);
  }
  float c = 1.f;
  if (new_m != m) {
    float cbuf[W];
    Isa::store(cbuf, Isa::exp_nonpos(Isa::set1(m - new_m)));  // 0 for the first block (m = -inf)
    c = cbuf[0];
  }
  Isa::store(lv, Isa::fmadd(Isa::load(lv), Isa::set1(c), sum));
  m = new_m;
  return c;
}

// ------------------------------------------------------------------------------------------------ fp32 path
// Packed per block: K^T [D, BS] and V [BS, D] fp32 (zero past the chunk's end); per task: the tile's queries.
template <int64_t kD>
struct F32Worker {
  using T = float;
  static int64_t unit(const Args& a) { return a.BS; }
  static constexpr int64_t kPV = std::max<int64_t>(1, 16 / (kD / W));  // rows per P V group (16 accumulators)
  // rows per scores group (tile rows are padded to a multiple): 8 with AVX-512 (32 zmm), 6 with AVX2 (16 ymm:
  // 6 rows x 16 keys = 12 accumulators, 2 key vectors, 1 broadcast)
  static constexpr int64_t kSRows = W == 8 ? 6 : kRows;
  static int64_t k_size(const Args& a) { return kD * a.BS; }
  static int64_t v_size(const Args& a) { return kD * a.BS; }
  static void pack(const Args& a, int64_t j, int64_t kh, float* kt, float* vb) {
    const int64_t BS = a.BS, row = a.KVH * kD, have = std::min(BS, a.ctx + a.n - j * BS);
    const float* kb = a.kc + (a.bt[j] * BS * a.KVH + kh) * kD;
    const float* vsrc = a.vc + (a.bt[j] * BS * a.KVH + kh) * kD;
    for (int64_t t = 0; t < BS; ++t) {
      if (t < have) {
        for (int64_t d = 0; d < kD; ++d) kt[d * BS + t] = kb[t * row + d];
        std::memcpy(&vb[t * kD], vsrc + t * row, kD * sizeof(float));
      } else {
        for (int64_t d = 0; d < kD; ++d) kt[d * BS + t] = 0.f;
        std::fill(&vb[t * kD], &vb[t * kD] + kD, 0.f);
      }
    }
  }
  const Args& a;
  const Packed<float>& packed;
  const float* kt = nullptr;
  const float* vb = nullptr;
  std::vector<float> qs, s, acc, m, l, c;
  F32Worker(const Args& args, const Packed<float>& pk)
      : a(args), packed(pk), qs((kTileQ * args.G + kSRows) * kD), s((kTileQ * args.G + kSRows) * args.BS),
        acc(kTileQ * args.G * kD), m(kTileQ * args.G), l(kTileQ * args.G * W), c(kTileQ * args.G) {}

  void task(int64_t kh, int64_t i0, int64_t nq) {
    const int64_t G = a.G, BS = a.BS, rows = nq * G;
    const int64_t padded = (rows + kSRows - 1) / kSRows * kSRows;
    for (int64_t r = 0; r < padded; ++r) {
      if (r < rows) std::memcpy(&qs[r * kD], a.qrow(i0 + r / G, kh * G + r % G), kD * sizeof(float));
      else std::fill(&qs[r * kD], &qs[r * kD] + kD, 0.f);
    }
    std::fill(acc.begin(), acc.begin() + rows * kD, 0.f);
    std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + rows * W, 0.f);
    const int64_t last = a.ctx + i0 + nq - 1;
    for (int64_t j = 0; j * BS <= last; ++j) {
      kt = packed.kblock(kh, j);
      vb = packed.vblock(kh, j);
      // rows r >= first see this block (query position ctx + i0 + r / G >= j * BS)
      const int64_t first = std::max<int64_t>(0, j * BS - a.ctx - i0) * G;
      for (int64_t r0 = first / kSRows * kSRows; r0 < padded; r0 += kSRows) {
        if constexpr (W == 8) scores8(r0);
        else scores(r0);
      }
      for (int64_t r = first; r < rows; ++r) {
        const int64_t valid = std::min(BS, a.ctx + i0 + r / G - j * BS + 1);
        c[r] = softmax_step(&s[r * BS], BS, valid, a.scale, m[r], &l[r * W]);
      }
      int64_t r = first;
      if constexpr (W == 8) {
        for (; r + 3 <= rows; r += 3) pv8<3>(r);
        for (; r < rows; ++r) pv8<1>(r);
      } else {
        for (; r + kPV <= rows; r += kPV) pv<kPV>(r);
        for (; r < rows; ++r) pv<1>(r);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = a.orow(i0 + r / G, kh * G + r % G);
      const float inv = 1.f / Isa::hsum(Isa::load(&l[r * W]));
      for (int64_t d = 0; d < kD; ++d) o[d] = acc[r * kD + d] * inv;
    }
  }

  // s[r, :] = q[r] . K^T for rows r0 .. r0 + kRows: per row and key vector two FMA chains (even / odd d), summed.
  void scores(int64_t r0) {
    const int64_t BS = a.BS;
    for (int64_t cv = 0; cv < BS; cv += W) {
      Vec e[kRows], o[kRows];
      for (int64_t r = 0; r < kRows; ++r) e[r] = o[r] = Isa::zero();
      const float* qr = &qs[r0 * kD];
      for (int64_t d = 0; d < kD; d += 2) {
        const Vec k0 = Isa::load(&kt[d * BS + cv]), k1 = Isa::load(&kt[(d + 1) * BS + cv]);
        for (int64_t r = 0; r < kRows; ++r) {
          e[r] = Isa::fmadd(Isa::set1(qr[r * kD + d]), k0, e[r]);
          o[r] = Isa::fmadd(Isa::set1(qr[r * kD + d + 1]), k1, o[r]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) Isa::store(&s[(r0 + r) * BS + cv], Isa::add(e[r], o[r]));
    }
  }

  // acc[r] = acc[r] * c[r] + sum_t p[r, t] v[t] for rows r0 .. r0 + R (one FMA chain per output vector).
  template <int64_t R>
  void pv(int64_t r0) {
    constexpr int64_t kV = kD / W;
    const int64_t BS = a.BS;
    Vec x[R][kV];
    for (int64_t r = 0; r < R; ++r) {
      const Vec cr = Isa::set1(c[r0 + r]);
      for (int64_t v = 0; v < kV; ++v) x[r][v] = Isa::mul(Isa::load(&acc[(r0 + r) * kD + v * W]), cr);
    }
    for (int64_t t = 0; t < BS; ++t) {
      Vec vv[kV];
      for (int64_t v = 0; v < kV; ++v) vv[v] = Isa::load(&vb[t * kD + v * W]);
      for (int64_t r = 0; r < R; ++r) {
        const Vec p = Isa::set1(s[(r0 + r) * BS + t]);
        for (int64_t v = 0; v < kV; ++v) x[r][v] = Isa::fmadd(p, vv[v], x[r][v]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < kV; ++v) Isa::store(&acc[(r0 + r) * kD + v * W], x[r][v]);
  }

  // AVX2 (16 ymm registers) scores of rows r0 .. r0 + kSRows: per 16 keys, one FMA chain per (row, 8 keys) over d
  // in order (12 accumulators; the 2 key vectors of d are loaded once for all rows). Every row runs the same
  // instructions whatever its group.
  void scores8(int64_t r0) {
    constexpr int64_t R = kSRows;
    const int64_t BS = a.BS;
    const float* qr = &qs[r0 * kD];
    for (int64_t cv = 0; cv < BS; cv += 2 * W) {
      Vec x0[R], x1[R];
      for (int64_t r = 0; r < R; ++r) x0[r] = x1[r] = Isa::zero();
      for (int64_t d = 0; d < kD; ++d) {
        const Vec k0 = Isa::load(&kt[d * BS + cv]), k1 = Isa::load(&kt[d * BS + cv + W]);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          const Vec qv = Isa::set1(qr[r * kD + d]);
          x0[r] = Isa::fmadd(qv, k0, x0[r]);
          x1[r] = Isa::fmadd(qv, k1, x1[r]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        Isa::store(&s[(r0 + r) * BS + cv], x0[r]);
        Isa::store(&s[(r0 + r) * BS + cv + W], x1[r]);
      }
    }
  }

  // AVX2 P V of rows r0 .. r0 + R, 4 output vectors (32 dims) at a time: R x 4 accumulators, R broadcasts of p and
  // one value vector in registers (R = 3: 16 ymm). Lane for lane the same arithmetic as pv (acc * c, then one FMA
  // per key in order).
  template <int64_t R>
  void pv8(int64_t r0) {
    constexpr int64_t kV = kD / W, kC = 4;
    const int64_t BS = a.BS;
    for (int64_t v0 = 0; v0 < kV; v0 += kC) {
      Vec x[R][kC];
      for (int64_t r = 0; r < R; ++r) {
        const Vec cr = Isa::set1(c[r0 + r]);
        for (int64_t v = 0; v < kC; ++v) x[r][v] = Isa::mul(Isa::load(&acc[(r0 + r) * kD + (v0 + v) * W]), cr);
      }
      const float* vt = vb + v0 * W;
      for (int64_t t = 0; t < BS; ++t, vt += kD) {
        Vec p[R];
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) p[r] = Isa::set1(s[(r0 + r) * BS + t]);
#pragma GCC unroll 8
        for (int64_t v = 0; v < kC; ++v) {
          const Vec vv = Isa::load(vt + v * W);
#pragma GCC unroll 8
          for (int64_t r = 0; r < R; ++r) x[r][v] = Isa::fmadd(p[r], vv, x[r][v]);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t v = 0; v < kC; ++v) Isa::store(&acc[(r0 + r) * kD + (v0 + v) * W], x[r][v]);
    }
  }
};

#ifdef LS_PREFILL_BF16
// ------------------------------------------------------------------------------------------------ bf16 path
// Pair-packed operands of vdpbf16ps (acc[lane] += a[2 lane] b[2 lane] + a[2 lane + 1] b[2 lane + 1]):
// Q rows as bf16 [rows, D] (pair p = dims 2p, 2p + 1); K as [D / 2, BS] pairs (key t's dims 2p, 2p + 1 at
// [p, t]); P rows as bf16 [rows, BS] (pair = keys 2u, 2u + 1); V as [BS / 2, D] pairs (keys 2u, 2u + 1 of dim d
// at [u, d]).
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m256i bf16x16(const float* x) {
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x));
  return reinterpret_cast<const __m256i&>(h);
}

template <int64_t kD>
struct Bf16Worker {
  using T = uint32_t;
  static int64_t unit(const Args& a) { return a.BS; }
  static constexpr int64_t kPV = std::max<int64_t>(1, 16 / (kD / 16));
  static int64_t k_size(const Args& a) { return kD / 2 * a.BS; }
  static int64_t v_size(const Args& a) { return kD / 2 * a.BS; }
  static void pack(const Args& a, int64_t j, int64_t kh, uint32_t* kp, uint32_t* vp) {
    const int64_t BS = a.BS, row = a.KVH * kD, have = std::min(BS, a.ctx + a.n - j * BS);
    const float* kb = a.kc + (a.bt[j] * BS * a.KVH + kh) * kD;
    const float* vsrc = a.vc + (a.bt[j] * BS * a.KVH + kh) * kD;
    alignas(64) uint32_t krow[kD / 2];
    for (int64_t t = 0; t < BS; ++t) {  // K: key t's bf16 row is its pairs; transpose to [pair, key]
      if (t < have) {
        for (int64_t d = 0; d < kD; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(krow) + d),
                              bf16x16(kb + t * row + d));
        for (int64_t p = 0; p < kD / 2; ++p) kp[p * BS + t] = krow[p];
      } else {
        for (int64_t p = 0; p < kD / 2; ++p) kp[p * BS + t] = 0u;
      }
    }
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t u = 0; u < BS / 2; ++u)  // V: keys 2u, 2u + 1 interleaved per dimension
      for (int64_t d = 0; d < kD; d += 16) {
        const __m512 v0 = 2 * u < have ? _mm512_loadu_ps(vsrc + 2 * u * row + d) : _mm512_setzero_ps();
        const __m512 v1 = 2 * u + 1 < have ? _mm512_loadu_ps(vsrc + (2 * u + 1) * row + d) : _mm512_setzero_ps();
        const __m512bh both = _mm512_cvtne2ps_pbh(v1, v0);  // [bf16(v0) x 16, bf16(v1) x 16]
        const __m512i x = _mm512_permutexvar_epi16(inter, reinterpret_cast<const __m512i&>(both));
        _mm512_storeu_si512(&vp[u * kD + d], x);
      }
  }
  const Args& a;
  const Packed<uint32_t>& packed;
  const uint32_t* kp = nullptr;
  const uint32_t* vp = nullptr;
  std::vector<uint16_t> qs, pb;
  std::vector<float> s, acc, m, l, c;
  Bf16Worker(const Args& args, const Packed<uint32_t>& pk)
      : a(args), packed(pk), qs(kTileQ * args.G * kD), pb(kTileQ * args.G * args.BS),
        s(kTileQ * args.G * args.BS), acc(kTileQ * args.G * kD), m(kTileQ * args.G), l(kTileQ * args.G * W),
        c(kTileQ * args.G) {}

  void task(int64_t kh, int64_t i0, int64_t nq) {
    const int64_t G = a.G, BS = a.BS, rows = nq * G;
    const int64_t padded = (rows + kRows - 1) / kRows * kRows;
    for (int64_t r = 0; r < padded; ++r)
      for (int64_t d = 0; d < kD; d += 16) {
        __m256i h = _mm256_setzero_si256();
        if (r < rows) h = bf16x16(a.qrow(i0 + r / G, kh * G + r % G) + d);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&qs[r * kD + d]), h);
      }
    std::fill(acc.begin(), acc.begin() + rows * kD, 0.f);
    std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + rows * W, 0.f);
    const int64_t last = a.ctx + i0 + nq - 1;
    for (int64_t j = 0; j * BS <= last; ++j) {
      kp = packed.kblock(kh, j);
      vp = packed.vblock(kh, j);
      const int64_t first = std::max<int64_t>(0, j * BS - a.ctx - i0) * G;
      for (int64_t r0 = first / kRows * kRows; r0 < padded; r0 += kRows) scores(r0);
      for (int64_t r = first; r < rows; ++r) {
        const int64_t valid = std::min(BS, a.ctx + i0 + r / G - j * BS + 1);
        c[r] = softmax_step(&s[r * BS], BS, valid, a.scale, m[r], &l[r * W]);
        for (int64_t t = 0; t < BS; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[r * BS + t]), bf16x16(&s[r * BS + t]));
      }
      int64_t r = first;
      for (; r + kPV <= rows; r += kPV) pv<kPV>(r);
      for (; r < rows; ++r) pv<1>(r);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = a.orow(i0 + r / G, kh * G + r % G);
      const float inv = 1.f / Isa::hsum(Isa::load(&l[r * W]));
      for (int64_t d = 0; d < kD; ++d) o[d] = acc[r * kD + d] * inv;
    }
  }

  // s[r, :] = bf16(q[r]) . bf16(K)^T for rows r0 .. r0 + kRows: two vdpbf16ps chains (even / odd pairs), summed.
  void scores(int64_t r0) {
    const int64_t BS = a.BS;
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(&qs[r0 * kD]);
    for (int64_t cv = 0; cv < BS; cv += 16) {
      __m512 e[kRows], o[kRows];
      for (int64_t r = 0; r < kRows; ++r) e[r] = o[r] = _mm512_setzero_ps();
      for (int64_t p = 0; p < kD / 2; p += 2) {
        const __m512bh k0 = as_bh(_mm512_loadu_si512(&kp[p * BS + cv]));
        const __m512bh k1 = as_bh(_mm512_loadu_si512(&kp[(p + 1) * BS + cv]));
        for (int64_t r = 0; r < kRows; ++r) {
          e[r] = _mm512_dpbf16_ps(e[r], k0, as_bh(_mm512_set1_epi32(static_cast<int>(q32[r * kD / 2 + p]))));
          o[r] = _mm512_dpbf16_ps(o[r], k1, as_bh(_mm512_set1_epi32(static_cast<int>(q32[r * kD / 2 + p + 1]))));
        }
      }
      for (int64_t r = 0; r < kRows; ++r) _mm512_storeu_ps(&s[(r0 + r) * BS + cv], _mm512_add_ps(e[r], o[r]));
    }
  }

  // acc[r] = acc[r] * c[r] + sum_u (p[r, 2u] v[2u] + p[r, 2u + 1] v[2u + 1]), one vdpbf16ps chain per vector.
  template <int64_t R>
  void pv(int64_t r0) {
    constexpr int64_t kV = kD / 16;
    const int64_t BS = a.BS;
    __m512 x[R][kV];
    for (int64_t r = 0; r < R; ++r) {
      const __m512 cr = _mm512_set1_ps(c[r0 + r]);
      for (int64_t v = 0; v < kV; ++v) x[r][v] = _mm512_mul_ps(_mm512_loadu_ps(&acc[(r0 + r) * kD + v * 16]), cr);
    }
    for (int64_t u = 0; u < BS / 2; ++u) {
      __m512bh vv[kV];
      for (int64_t v = 0; v < kV; ++v) vv[v] = as_bh(_mm512_loadu_si512(&vp[u * kD + v * 16]));
      for (int64_t r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, &pb[(r0 + r) * BS + 2 * u], sizeof(pair));
        const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int64_t v = 0; v < kV; ++v) x[r][v] = _mm512_dpbf16_ps(x[r][v], vv[v], p);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < kV; ++v) _mm512_storeu_ps(&acc[(r0 + r) * kD + v * 16], x[r][v]);
  }
};

// ------------------------------------------------------------------------------------------------ AMX path
// The bf16 path's operands (bf16 Q, K, V and P, fp32 sums, scores and softmax in fp32) with both products on AMX
// tiles (amx_tiles.h): S = Q K^T and P V as TDPBF16PS over 16-row tiles of the task's rows. The online softmax
// steps over units of S = amx_step_keys(BS) keys (whole cache blocks: 64 keys for block sizes 16, 32 and 64), so
// a tile's K-dimension is full; units are counted from key 0 whatever the chunk, so a row still runs the same
// instructions over the same units (its last one masked past its position), and rows that do not reach a unit
// are not updated by it (their accumulators are written back only for the rows that see it).
// Packed per unit: K as [D / 2, S] pairs (the B tiles of the scores: pair row p, 16 keys per tile), V as
// [S / 2, D] pairs (the B tiles of P V: key-pair row u, 16 dims per tile); keys past the chunk's end are zero.
inline int64_t amx_step_keys(int64_t BS) { return BS >= 64 ? BS : (64 % BS == 0 ? 64 : BS); }
// Whether the AMX path takes this block size: its unit a multiple of 32 keys (a full tile of P pairs), <= 128 (P's
// four A tiles).
inline bool amx_takes(int64_t BS) {
  if (BS <= 0) return false;
  const int64_t step = amx_step_keys(BS);
  return BS % 16 == 0 && step % 32 == 0 && step <= 128;
}

template <int64_t kD, class Tiles>
struct AmxWorker {
  using T = uint32_t;
  static constexpr int64_t kQC = kD / 32;  // Q's 32-dim chunks: the A tiles of the scores (2 or 4)
  static constexpr int64_t kTR = 16;       // rows per tile
  static int64_t unit(const Args& a) { return amx_step_keys(a.BS); }
  static int64_t k_size(const Args& a) { return kD / 2 * unit(a); }
  static int64_t v_size(const Args& a) { return kD / 2 * unit(a); }
  static void pack(const Args& a, int64_t j, int64_t kh, uint32_t* kp, uint32_t* vp) {
    const int64_t S = unit(a), BS = a.BS, row = a.KVH * kD, end = a.ctx + a.n;
    auto key = [&](const float* cache, int64_t t) -> const float* {  // key t of unit j, or null past the chunk
      const int64_t p = j * S + t;
      return p < end ? cache + (a.bt[p / BS] * BS + p % BS) * row + kh * kD : nullptr;
    };
    alignas(64) uint32_t krow[kD / 2];
    for (int64_t t = 0; t < S; ++t) {
      const float* kr = key(a.kc, t);
      if (kr) {
        for (int64_t d = 0; d < kD; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(krow) + d), bf16x16(kr + d));
        for (int64_t p = 0; p < kD / 2; ++p) kp[p * S + t] = krow[p];
      } else {
        for (int64_t p = 0; p < kD / 2; ++p) kp[p * S + t] = 0u;
      }
    }
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t u = 0; u < S / 2; ++u) {
      const float* v0 = key(a.vc, 2 * u);
      const float* v1 = key(a.vc, 2 * u + 1);
      for (int64_t d = 0; d < kD; d += 16) {
        const __m512bh both = _mm512_cvtne2ps_pbh(v1 ? _mm512_loadu_ps(v1 + d) : _mm512_setzero_ps(),
                                                  v0 ? _mm512_loadu_ps(v0 + d) : _mm512_setzero_ps());
        _mm512_storeu_si512(&vp[u * kD + d], _mm512_permutexvar_epi16(inter, reinterpret_cast<const __m512i&>(both)));
      }
    }
  }
  const Args& a;
  const Packed<uint32_t>& packed;
  const int64_t S;
  std::vector<uint16_t> qs, pb;
  std::vector<float> s, acc, m, l, c;
  AmxWorker(const Args& args, const Packed<uint32_t>& pk)
      : a(args), packed(pk), S(unit(args)), qs(pad(args) * kD), pb(pad(args) * S), s(pad(args) * S),
        acc(pad(args) * kD), m(pad(args)), l(pad(args) * W), c(pad(args)) {}
  static int64_t pad(const Args& a) { return (kTileQ * a.G + kTR - 1) / kTR * kTR; }

  void task(int64_t kh, int64_t i0, int64_t nq) {
    const int64_t G = a.G, rows = nq * G, tiles = (rows + kTR - 1) / kTR;
    for (int64_t r = 0; r < tiles * kTR; ++r)
      for (int64_t d = 0; d < kD; d += 16) {
        __m256i h = _mm256_setzero_si256();
        if (r < rows) h = bf16x16(a.qrow(i0 + r / G, kh * G + r % G) + d);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&qs[r * kD + d]), h);
      }
    std::fill(acc.begin(), acc.begin() + rows * kD, 0.f);
    std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + rows * W, 0.f);
    std::fill(pb.begin(), pb.end(), uint16_t{0});  // rows that skip a unit still go through its tiles
    const int64_t last = a.ctx + i0 + nq - 1;
    Tiles::begin();
    for (int64_t j = 0; j * S <= last; ++j) {
      const uint32_t* kp = packed.kblock(kh, j);
      const uint32_t* vp = packed.vblock(kh, j);
      const int64_t first = std::max<int64_t>(0, j * S - a.ctx - i0) * G;  // rows r >= first see unit j
      for (int64_t t = first / kTR; t < tiles; ++t) scores(t, kp);
      for (int64_t r = first; r < rows; ++r) {
        const int64_t valid = std::min(S, a.ctx + i0 + r / G - j * S + 1);
        c[r] = softmax_step(&s[r * S], S, valid, a.scale, m[r], &l[r * W]);
        for (int64_t t = 0; t < S; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[r * S + t]), bf16x16(&s[r * S + t]));
      }
      for (int64_t t = first / kTR; t < tiles; ++t) pv(t, vp, first, rows);
    }
    Tiles::end();
    for (int64_t r = 0; r < rows; ++r) {
      float* o = a.orow(i0 + r / G, kh * G + r % G);
      const float inv = 1.f / Isa::hsum(Isa::load(&l[r * W]));
      for (int64_t d = 0; d < kD; ++d) o[d] = acc[r * kD + d] * inv;
    }
  }

  // Loads tiles 2, 3, ... with the kN 32-element chunks of a 16-row operand at p (rows at stride bytes).
  template <int64_t kN, int64_t i = 0>
  static void load_a(const uint16_t* p, int64_t stride) {
    if constexpr (i < kN) {
      Tiles::template load<2 + i>(p + 32 * i, stride);
      load_a<kN, i + 1>(p, stride);
    }
  }
  // C0 += A(2 + i) B6 and C1 += A(2 + i) B7 for the chunks i of the A operand, B tiles from b(i) and b(i) + 16.
  template <int64_t kN, int64_t i = 0, class F>
  static void dots(F b, int64_t stride) {
    if constexpr (i < kN) {
      const uint32_t* p = b(i);
      Tiles::template load<6>(p, stride);
      Tiles::template load<7>(p + 16, stride);
      Tiles::template dot<0, 2 + i, 6>();
      Tiles::template dot<1, 2 + i, 7>();
      dots<kN, i + 1>(b, stride);
    }
  }

  // s[rows of tile t, 0 .. S) = q . K^T: per 32 keys, tiles C0 C1 over Q's kQC chunks (A tiles 2 ..).
  void scores(int64_t t, const uint32_t* kp) {
    load_a<kQC>(&qs[t * kTR * kD], kD * 2);
    float* st = &s[t * kTR * S];
    for (int64_t n = 0; n < S; n += 32) {
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      dots<kQC>([&](int64_t i) { return kp + 16 * i * S + n; }, S * 4);
      Tiles::template store<0>(st + n, S * 4);
      Tiles::template store<1>(st + n + 16, S * 4);
    }
  }

  // Rows [max(first, tile start), rows) of tile t: acc = acc * c + P V, per 32 dims tiles C0 C1 over P's S / 32
  // chunks (A tiles 2 ..), then added to the rescaled accumulators in fp32.
  void pv(int64_t t, const uint32_t* vp, int64_t first, int64_t rows) {
    const int64_t r0 = t * kTR;
    switch (S / 32) {
      case 1: load_a<1>(&pb[r0 * S], S * 2); break;
      case 2: load_a<2>(&pb[r0 * S], S * 2); break;
      case 3: load_a<3>(&pb[r0 * S], S * 2); break;
      default: load_a<4>(&pb[r0 * S], S * 2); break;
    }
    alignas(64) float tmp[kTR * 32];
    for (int64_t d0 = 0; d0 < kD; d0 += 32) {
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      auto b = [&](int64_t i) { return vp + 16 * i * kD + d0; };
      switch (S / 32) {
        case 1: dots<1>(b, kD * 4); break;
        case 2: dots<2>(b, kD * 4); break;
        case 3: dots<3>(b, kD * 4); break;
        default: dots<4>(b, kD * 4); break;
      }
      Tiles::template store<0>(tmp, 32 * 4);
      Tiles::template store<1>(tmp + 16, 32 * 4);
      for (int64_t r = std::max(first, r0); r < std::min(rows, r0 + kTR); ++r) {
        float* ar = &acc[r * kD + d0];
        const __m512 cr = _mm512_set1_ps(c[r]);
        const float* pr = tmp + (r - r0) * 32;
        _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_loadu_ps(ar), cr, _mm512_loadu_ps(pr)));
        _mm512_storeu_ps(ar + 16, _mm512_fmadd_ps(_mm512_loadu_ps(ar + 16), cr, _mm512_loadu_ps(pr + 16)));
      }
    }
  }
};
#endif  // LS_PREFILL_BF16
#endif  // AVX2 + FMA

}  // namespace

// Whether the AMX path takes this block size (amx_takes; false in a build without the bf16 path, which has no AMX
// path): the engine to report for a cache of this block size.
bool prefill_attention_amx_takes(int64_t block_size) {
#ifdef LS_PREFILL_BF16
  return amx_takes(block_size);
#else
  (void)block_size;
  return false;
#endif
}

// Whether this build has the bf16 path (AVX512_BF16); without it use_bf16 is refused.
bool prefill_attention_bf16_simd() {
#ifdef LS_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

// See the top of this file. use_bf16: the bf16 dot-product path (needs prefill_attention_bf16_simd()); engine
// (bf16 path only): "avx512_bf16" (vdpbf16ps), "amx" (AMX tiles, needs amx_bf16_status() == "ready"; block sizes
// whose unit amx_takes() refuses run avx512_bf16) or "amx_emulated" (the AMX program on emulated tiles, for tests).
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_ids, int64_t context_len, double scale, bool use_bf16,
                                      c10::optional<torch::Tensor> out_opt, const std::string& engine) {
  TORCH_CHECK(engine == "avx512_bf16" || engine == "amx" || engine == "amx_emulated",
              "paged_prefill_attention: engine must be avx512_bf16, amx or amx_emulated, not ", engine);
  TORCH_CHECK(engine != "amx" || leanserve::amx_bf16_status() == "ready",
              "paged_prefill_attention: this process cannot run AMX tiles (", leanserve::amx_bf16_status(), ")");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_prefill_attention: float32 q and KV cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_prefill_attention: contiguous KV cache");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) > 0 && k_cache.size(2) > 0,
              "paged_prefill_attention: caches [blocks, block_size, KVH, D] with block_size and KVH > 0");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_prefill_attention: q [n, H, D], caches [blocks, block_size, KVH, D] with KVH dividing H");
  // a row's heads contiguous (any row stride: q may be the q columns of the fused qkv product), as the output's
  auto rows_dense = [](const torch::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) && (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
  };
  TORCH_CHECK(rows_dense(q), "paged_prefill_attention: q's rows must hold their heads contiguously");
  TORCH_CHECK(block_ids.dtype() == torch::kInt64 && block_ids.dim() == 1, "paged_prefill_attention: int64 block ids");
  TORCH_CHECK(context_len >= 0, "paged_prefill_attention: context_len >= 0");
  const int64_t n = q.size(0), BS = k_cache.size(1);
  TORCH_CHECK(context_len <= block_ids.size(0) * BS - n,  // no overflow of context_len + n
              "paged_prefill_attention: the block table does not cover context_len + n tokens");
  auto ids = block_ids.contiguous();
  const int64_t* bt = ids.data_ptr<int64_t>();
  const int64_t used = (context_len + n + BS - 1) / BS;
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(bt[j] >= 0 && bt[j] < k_cache.size(0), "paged_prefill_attention: block id out of range");
#ifndef LS_PREFILL_BF16
  TORCH_CHECK(!use_bf16, "paged_prefill_attention: this build has no AVX512_BF16 path");
#endif
  torch::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.dtype() == torch::kFloat32 && out.sizes() == q.sizes() && rows_dense(out),
                "paged_prefill_attention: out must be float32 like q, its rows' heads contiguous");
  } else {
    out = torch::empty(q.sizes(), q.options());
  }
  if (n == 0) return out;
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, out.data_ptr<float>(),
         n, q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), BS, context_len,
         static_cast<float>(scale), q.stride(0), out.stride(0)};
#if defined(__AVX2__) && defined(__FMA__)
  const bool simd = BS % 16 == 0 && (a.D == 64 || a.D == 128);
#ifdef LS_PREFILL_BF16
  if (use_bf16 && simd && engine != "avx512_bf16" && amx_takes(BS)) {
    if (engine == "amx_emulated") {
      if (a.D == 64) return run_tasks<AmxWorker<64, leanserve::amx::EmulatedTiles>>(a), out;
      return run_tasks<AmxWorker<128, leanserve::amx::EmulatedTiles>>(a), out;
    }
#ifdef LS_AMX_HW
    if (a.D == 64) return run_tasks<AmxWorker<64, leanserve::amx::HardwareTiles>>(a), out;
    return run_tasks<AmxWorker<128, leanserve::amx::HardwareTiles>>(a), out;
#endif
  }
  if (use_bf16) {
    if (simd && a.D == 64) return run_tasks<Bf16Worker<64>>(a), out;
    if (simd) return run_tasks<Bf16Worker<128>>(a), out;
  }
#endif
  if (!use_bf16 && simd && a.D == 64) return run_tasks<F32Worker<64>>(a), out;
  if (!use_bf16 && simd) return run_tasks<F32Worker<128>>(a), out;
#endif
  TORCH_CHECK(!use_bf16, "paged_prefill_attention: the bf16 path needs head_dim 64 or 128 and block_size % 16 == 0");
  run_tasks<ScalarWorker>(a);
  return out;
}
