// Paged decode attention for CPU: one query token per sequence, keys/values read in place from the paged KV cache
// through each sequence's block table (no gather, no padding). Online softmax per block of tokens (Milakov &
// Gimelshein 2018, "Online normalizer calculation for softmax"), split over sequences x KV heads x partitions of a
// long sequence's keys (flash-decoding; see DecodeSplit).
//
// q:            [N, H, D] float32, contiguous (N sequences, H query heads)
// k/v_cache:    [num_blocks, block_size, KVH, D] float32 or float16 (read as float32), contiguous
// block_tables: [N, max_blocks] int64; seq_lens: [N] int64 (tokens to attend, the new one included)
// returns       [N, H, D] float32. The G = H / KVH query heads of a KV head share its keys (GQA).
#include <torch/extension.h>
#include "simd_exp.h"
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Keys per partition of a long sequence (a multiple of the block size: max(1, kPartTokens / block_size) blocks).
constexpr int64_t kPartTokens = 256;
// Keys read per KV head, over all sequences, below which one thread does the whole call (the work is too small to
// share: waking the pool costs more than it saves).
constexpr int64_t kParallelKeys = 2048;

// The kernels' tasks (flash-decoding's split, Dao et al. 2023, "Flash-Decoding for long-context inference"): a task
// is one sequence n, the KV heads [h0, h0 + hpt) and its key blocks [jb, je). A sequence of more than kPartTokens keys
// is cut into partitions of kPartTokens keys (whatever the batch, the thread count or the task split, so that a
// sequence's result depends on itself only); each partition's task leaves its running max m, sum l and unnormalized
// accumulator acc in a partial slot, and merge() combines a sequence's partitions in their order:
//   M = max_p m_p,  out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p.
// A sequence of one partition writes out = acc / l itself (finish).
struct DecodeSplit {
  struct Task {
    int64_t n, h0, jb, je, slot;  // slot: the partial slot, or -1 when the task covers the whole sequence
  };
  struct Group {
    int64_t n, h0, first, count;  // partial slots [first, first + count) of sequence n, heads from h0
  };
  std::vector<Task> tasks;
  std::vector<Group> groups;
  int64_t hpt = 1;    // KV heads per task
  int64_t grain = 1;  // parallel_for's grain: all tasks on the calling thread below kParallelKeys keys
  int64_t width, dim;  // query heads per task (hpt * G) and head size
  std::vector<float> pm, pl, pacc;  // partial slots: [slots, width], [slots, width], [slots, width, dim]

  // Partitions of a sequence of len keys in blocks of BS.
  static int64_t parts(int64_t len, int64_t BS) {
    const int64_t per_part = std::max<int64_t>(1, kPartTokens / BS);
    return std::max<int64_t>(1, ((len + BS - 1) / BS + per_part - 1) / per_part);
  }

  // all_heads: the kernel can take all KV heads per task (the SIMD kernels). It does so (a task then reads each
  // token's rows for all KV heads at once, contiguous memory that the hardware prefetcher streams at ~2x the rate of
  // a per-head stride) when that leaves at least two tasks per thread, or when one thread does a call of 512 keys or
  // more; else one head per task (below 512 keys the rows mostly come from cache, where the AVX2 kernel's copy of
  // the contiguous rows costs more than it saves: benchmarks.attention --kernel-batches).
  DecodeSplit(const int64_t* sl, int64_t N, int64_t KVH, int64_t G, int64_t D, int64_t BS, bool all_heads)
      : dim(D) {
    int64_t keys = 0, total_parts = 0;
    for (int64_t n = 0; n < N; ++n) {
      keys += sl[n];
      total_parts += parts(sl[n], BS);
    }
    if (all_heads && (total_parts >= 2 * at::get_num_threads() || (keys >= 2 * kPartTokens && keys < kParallelKeys)))
      hpt = KVH;
    width = hpt * G;
    const int64_t per_part = std::max<int64_t>(1, kPartTokens / BS);
    int64_t slots = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t blocks = (sl[n] + BS - 1) / BS, count = parts(sl[n], BS);
      for (int64_t h0 = 0; h0 < KVH; h0 += hpt) {
        if (count == 1) {
          tasks.push_back({n, h0, 0, blocks, -1});
          continue;
        }
        groups.push_back({n, h0, slots, count});
        for (int64_t p = 0; p < count; ++p)
          tasks.push_back({n, h0, p * per_part, std::min(blocks, (p + 1) * per_part), slots++});
      }
    }
    if (keys < kParallelKeys) grain = std::max<int64_t>(1, size());
    pm.resize(slots * width);
    pl.resize(slots * width);
    pacc.resize(slots * width * dim);
  }

  int64_t size() const { return static_cast<int64_t>(tasks.size()); }

  // A block pos blocks after the first block of task idx, in the order a thread reads its tasks [idx, end): the
  // task's own blocks, then the next tasks'. base: the element offset of its first token's row for the task's first
  // KV head (row elements per token, D per head); cnt: its tokens, 0 where the thread reads no such block.
  struct BlockRef {
    int64_t base = 0, cnt = 0;
  };
  BlockRef block_at(int64_t idx, int64_t end, int64_t pos, const int64_t* bt, int64_t MB, const int64_t* sl,
                    int64_t BS, int64_t row) const {
    for (; idx < end; ++idx) {
      const Task& t = tasks[idx];
      if (pos < t.je - t.jb) {
        const int64_t j = t.jb + pos;
        return {bt[t.n * MB + j] * BS * row + t.h0 * dim, std::min(BS, sl[t.n] - j * BS)};
      }
      pos -= t.je - t.jb;
    }
    return {};
  }

  // Task i's result: acc [width, dim], m, l [width]; out: the task's first query head's row in the output.
  void finish(int64_t i, const float* acc, const float* m, const float* l, float* out) {
    const int64_t slot = tasks[i].slot;
    if (slot < 0) {
      for (int64_t e = 0; e < width * dim; ++e) out[e] = acc[e] / l[e / dim];
      return;
    }
    std::memcpy(pm.data() + slot * width, m, width * sizeof(float));
    std::memcpy(pl.data() + slot * width, l, width * sizeof(float));
    std::memcpy(pacc.data() + slot * width * dim, acc, width * dim * sizeof(float));
  }

  // The partitioned sequences' outputs (out [N, H, D]), after all tasks finished.
  void merge(float* out, int64_t H, int64_t G) const {
    std::vector<float> w;
    for (const Group& grp : groups) {
      float* on = out + (grp.n * H + grp.h0 * G) * dim;
      for (int64_t h = 0; h < width; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < grp.count; ++p) mx = std::max(mx, pm[(grp.first + p) * width + h]);
        w.assign(grp.count, 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < grp.count; ++p) {
          w[p] = std::exp(pm[(grp.first + p) * width + h] - mx);
          total += w[p] * pl[(grp.first + p) * width + h];
        }
        for (int64_t d = 0; d < dim; ++d) {
          float a = 0.f;
          for (int64_t p = 0; p < grp.count; ++p) a += w[p] * pacc[((grp.first + p) * width + h) * dim + d];
          on[h * dim + d] = a / total;
        }
      }
    }
  }
};

}  // namespace

// kD, kG > 0: head size and query heads per KV head known at compile time (fully vectorized loops); 0: runtime.
template <typename T, int64_t kD, int64_t kG>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& bt_c, const torch::Tensor& sl_c, double scale, torch::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1);
  const int64_t D = kD > 0 ? kD : q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = kG > 0 ? kG : H / KVH, MB = bt_c.size(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = bt_c.data_ptr<int64_t>();
  const int64_t* sl = sl_c.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  DecodeSplit split(sl, N, KVH, G, D, BS, false);
  leanserve::SpinPool::parallel_for(split.size(), split.grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * BS);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto& task = split.tasks[idx];
      const int64_t n = task.n, kh = task.h0;
      const float* qn = qp + (n * H + kh * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = sl[n];
      for (int64_t j = task.jb; j < task.je; ++j) {
        const int64_t blk = bt[n * MB + j];
        const int64_t cnt = std::min(BS, len - j * BS);
        const T* kb = kp + (blk * BS * KVH + kh) * D;
        const T* vb = vp + (blk * BS * KVH + kh) * D;
        for (int64_t t = 0; t < cnt; ++t) {
          const T* kr = kb + t * KVH * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qn + g * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kr[d]);
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
          const T* vr = vb + t * KVH * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * BS + t];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vr[d]);
          }
        }
      }
      split.finish(idx, acc.data(), m.data(), l.data(), op + (n * H + kh * G) * D);
    }
  });
  split.merge(op, H, G);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using leanserve::exp_nonpos;  // simd_exp.h

// Blocks read ahead of the one in use, and the hint. Blocks are scattered, so a thread prefetches the K and V rows
// of the block kAheadBlocks after the one it computes on (in its own order of blocks: its task's, then its next
// tasks', DecodeSplit::block_at), into L2 (T1; T0 evicted lines before they were read: two blocks ahead plus the
// current one, all 3 KV heads, float16, are 36 KiB, more than a 32 KiB L1). The prefetches are spread over the
// block's arithmetic, one token row of one KV head with each value row accumulated (prefetch_row, in the P.V loop),
// instead of one burst per block: a burst of a 12 KiB block's 192 lines filled the core's miss queue, and the loads
// of the block in use waited behind it (benchmarks/README.md, python -m benchmarks.attention --kernel-batches).
constexpr int64_t kAheadBlocks = 2;

// Prefetches (into L2) width elements of K and V from element offset at of the caches kp, vp.
template <typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* kp, const T* vp, int64_t at, int64_t width) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t c = 0; c < width; c += kLine) {
    _mm_prefetch(reinterpret_cast<const char*>(kp + at + c), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(vp + at + c), _MM_HINT_T1);
  }
}

// The block a thread prefetches while it computes on block j of task idx (j - jb blocks into the task), after, at
// the first block of its first task (idx == begin), prefetching the blocks between in full (every later block was
// prefetched, spread, while the ones kAheadBlocks before it were read). width: elements per token of the task's KV
// heads. Both helpers are always_inline: GCC 12 at -O2/-O3 found an out-of-line copy free of side effects (a
// prefetch is none, and C++ loops are finite) and dropped its calls.
template <typename T>
__attribute__((always_inline)) inline DecodeSplit::BlockRef block_ahead(
    const DecodeSplit& split, const T* kp, const T* vp, int64_t idx, int64_t begin, int64_t end, int64_t j,
    const int64_t* bt, int64_t MB, const int64_t* sl, int64_t BS, int64_t row, int64_t width) {
  const int64_t pos = j - split.tasks[idx].jb;
  if (idx == begin && pos == 0)
    for (int64_t p = 1; p < kAheadBlocks; ++p) {
      const DecodeSplit::BlockRef b = split.block_at(idx, end, p, bt, MB, sl, BS, row);
      for (int64_t t = 0; t < b.cnt; ++t) prefetch_row(kp, vp, b.base + t * row, width);
    }
  return split.block_at(idx, end, pos + kAheadBlocks, bt, MB, sl, BS, row);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of the 8 lanes of a, b, c and d, in that order: the same adds in the same order for each input, so that
// a key's score does not depend on its place in a tile (or on the other inputs).
inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of the kG query heads at qh ([kG, kD] float32, already scaled) against kTT (1, 2 or 4) keys kb[u * stride]
// (float32 or float16), of which the first nk are real (kFull: all kTT): s[g * padded + u] for u < kTT, 0 for u >=
// nk. The kG x kTT dot products are independent FMA chains (one chain per score took a chain's latency per key), each
// key row loaded (and converted) once for the kG heads.
template <typename T, int64_t kD, int64_t kG, int64_t kTT, bool kFull>
inline void scores_tile(const float* qh, const T* kb, int64_t stride, int64_t nk, float* s, int64_t padded) {
  static_assert(kTT == 1 || kTT == 2 || kTT == 4, "1, 2 or 4 keys per tile");
  __m256 a[kG][4];
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t u = 0; u < 4; ++u) a[g][u] = _mm256_setzero_ps();
  for (int64_t c = 0; c < kD / 8; ++c)
    for (int64_t u = 0; u < kTT; ++u) {
      if (!kFull && u >= nk) break;
      const __m256 kv = load8(kb + u * stride + 8 * c);
      for (int64_t g = 0; g < kG; ++g) a[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * kD + 8 * c), kv, a[g][u]);
    }
  for (int64_t g = 0; g < kG; ++g) {
    const __m128 r = hsum4x8(a[g][0], a[g][1], a[g][2], a[g][3]);
    float* sg = s + g * padded;
    if constexpr (kTT == 4) _mm_storeu_ps(sg, r);
    else if constexpr (kTT == 2) _mm_storel_pi(reinterpret_cast<__m64*>(sg), r);
    else _mm_store_ss(sg, r);
  }
}

// The same computation as decode_kernel with AVX2 intrinsics, for kD % 32 == 0: per block of keys the G scores of a
// key share one pass over its row, the softmax runs 8 keys at a time, and the value rows are accumulated into
// register tiles of kVC x 8 dimensions for all G heads (the running sums live in L1 between blocks).
// The step is bound by reading the cache (~20 GB/s for scattered blocks on a 2-core VM, where the arithmetic alone
// runs at ~65 GB/s from L2): a task copies each block into a local buffer (one streaming read of block_size rows,
// faster than strided loads interleaved with the arithmetic) and prefetches the block ahead (block_ahead, prefetch_row).
template <typename T, int64_t kD, int64_t kG>
void decode_kernel_avx2(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& bt_c, const torch::Tensor& sl_c, double scale, torch::Tensor& out) {
  static_assert(kD % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t kVC = kG <= 3 ? 4 : kG <= 7 ? 2 : 1;  // 8-float vectors per value tile: kG * kVC accumulators
  constexpr int64_t kTT = kG <= 3 ? 4 : kG <= 6 ? 2 : 1;  // keys per score tile: kG * kTT <= 12 accumulators
  const int64_t N = q.size(0), H = q.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = bt_c.size(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = bt_c.data_ptr<int64_t>();
  const int64_t* sl = sl_c.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row = KVH * kD;  // floats between consecutive tokens of one KV head
  const int64_t padded = (BS + 7) / 8 * 8;

  DecodeSplit split(sl, N, KVH, kG, kD, BS, true);
  const int64_t hpt = split.hpt;
  leanserve::SpinPool::parallel_for(split.size(), split.grain, [&](int64_t begin, int64_t end) {
    const int64_t state = hpt * kG * kD;
    std::vector<float> qs(state), acc(state), s(kG * padded);
    std::vector<T> kbuf(hpt == KVH ? BS * row : 0), vbuf(hpt == KVH ? BS * row : 0);
    std::vector<float> m(hpt * kG), l(hpt * kG);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto& task = split.tasks[idx];
      const int64_t n = task.n, h0 = task.h0;
      const float* qn = qp + (n * H + h0 * kG) * kD;
      for (int64_t i = 0; i < state; ++i) {
        qs[i] = qn[i] * sc;
        acc[i] = 0.f;
      }
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = sl[n];
      for (int64_t j = task.jb; j < task.je; ++j) {
        const int64_t cnt = std::min(BS, len - j * BS);
        const DecodeSplit::BlockRef next =
            block_ahead(split, kp, vp, idx, begin, end, j, bt, MB, sl, BS, row, hpt * kD);
        const T* kblk = kp + bt[n * MB + j] * BS * row;
        const T* vblk = vp + bt[n * MB + j] * BS * row;
        if (hpt == KVH) {  // the block's rows for all heads are contiguous
          std::memcpy(kbuf.data(), kblk, cnt * row * sizeof(T));
          std::memcpy(vbuf.data(), vblk, cnt * row * sizeof(T));
          kblk = kbuf.data();
          vblk = vbuf.data();
        }
        for (int64_t hh = 0; hh < hpt; ++hh) {
          const T* kb = kblk + (h0 + hh) * kD;
          const T* vb = vblk + (h0 + hh) * kD;
          const float* qh = qs.data() + hh * kG * kD;
          float* ah = acc.data() + hh * kG * kD;
          for (int64_t t = 0; t < cnt; t += kTT) {  // scores of the kG heads against keys t .. t + kTT - 1
            if (t + kTT <= cnt) scores_tile<T, kD, kG, kTT, true>(qh, kb + t * row, row, kTT, s.data() + t, padded);
            else scores_tile<T, kD, kG, kTT, false>(qh, kb + t * row, row, cnt - t, s.data() + t, padded);
          }
          for (int64_t g = 0; g < kG; ++g) {  // online softmax update
            float* sg = s.data() + g * padded;
            for (int64_t t = cnt; t < padded; ++t) sg[t] = neg_inf;
            __m256 mx = _mm256_set1_ps(neg_inf);
            for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float& mg = m[hh * kG + g];
            const float new_m = std::max(mg, _mm_cvtss_f32(m4));
            const __m256 nm = _mm256_set1_ps(new_m);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t t = 0; t < padded; t += 8) {
              const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sg + t), nm));
              _mm256_storeu_ps(sg + t, e);
              sum = _mm256_add_ps(sum, e);
            }
            const float c = std::exp(mg - new_m);  // 0 for the first block (m = -inf)
            l[hh * kG + g] = l[hh * kG + g] * c + hsum8(sum);
            mg = new_m;
            const __m256 cv = _mm256_set1_ps(c);
            for (int64_t d = 0; d < kD; d += 8)
              _mm256_storeu_ps(ah + g * kD + d, _mm256_mul_ps(cv, _mm256_loadu_ps(ah + g * kD + d)));
          }
          for (int64_t d0 = 0; d0 < kD; d0 += 8 * kVC) {  // acc[g, d0 : d0 + 8 kVC] += sum_t p[g, t] v[t, ...]
            __m256 a[kG][kVC];
            for (int64_t g = 0; g < kG; ++g)
              for (int64_t c = 0; c < kVC; ++c) a[g][c] = _mm256_loadu_ps(ah + g * kD + d0 + 8 * c);
            const int64_t ahead = d0 == 0 ? next.cnt : 0;  // rows of the block ahead to prefetch, head hh's
            for (int64_t t = 0; t < cnt; ++t) {
              if (t < ahead) prefetch_row(kp, vp, next.base + t * row + hh * kD, kD);
              const T* vr = vb + t * row + d0;
              __m256 vv[kVC];
              for (int64_t c = 0; c < kVC; ++c) vv[c] = load8(vr + 8 * c);
              for (int64_t g = 0; g < kG; ++g) {
                const __m256 p = _mm256_broadcast_ss(s.data() + g * padded + t);
                for (int64_t c = 0; c < kVC; ++c) a[g][c] = _mm256_fmadd_ps(p, vv[c], a[g][c]);
              }
            }
            for (int64_t g = 0; g < kG; ++g)
              for (int64_t c = 0; c < kVC; ++c) _mm256_storeu_ps(ah + g * kD + d0 + 8 * c, a[g][c]);
          }
        }
      }
      split.finish(idx, acc.data(), m.data(), l.data(), op + (n * H + h0 * kG) * kD);
    }
  });
  split.merge(op, H, kG);
}

}  // namespace
#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The transpose-reduce of 16 vectors of partial sums into one vector of their 16 sums, in four levels of pairwise
// shuffle + add (30 shuffles and 15 adds for 16 keys, instead of 16 horizontal sums of 8 dependent steps each).
// Levels 1-2 (reduce4) take 4 vectors a, b, c, d and give one whose 128-bit lane L holds 4 partial sums of input L.
// Levels 3-4 (reduce4x4) take four of those, x0..x3, and give one whose float 4 L + k is the sum of x_k's lane L,
// i.e. of input L of group k. With key 4 u + j as input u of group j, float i is key i's score.
inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 reduce4x4(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x2, x3), _mm512_unpackhi_ps(x2, x3));
  return _mm512_add_ps(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Scores of the kG query heads at qh ([kG, kD] float32, already scaled) against the keys kb[t * stride], t < nk
// <= 16 (float32 or float16): out[g] lane t holds head g's score of key t, lanes from nk on hold -inf. Each key row
// is loaded (and converted) once for the kG heads; 4 keys at a time give kG x 4 partial-sum vectors, reduced at
// once to kG vectors of 4 x 4 partial sums (the q vectors stay in registers where kG * kD / 16 allows).
template <typename T, int64_t kD, int64_t kG, bool kFull>
inline void scores16(const float* qh, const T* kb, int64_t stride, int64_t nk, __m512 (&out)[kG]) {
  constexpr int64_t kQV = kD / 16;
  __m512 x[kG][4];
  for (int64_t j = 0; j < 4; ++j) {
    __m512 part[kG][4];
    for (int64_t u = 0; u < 4; ++u) {
      const int64_t t = 4 * u + j;
      if (kFull || t < nk) {
        const T* kr = kb + t * stride;
        __m512 kv[kQV];
        for (int64_t c = 0; c < kQV; ++c) kv[c] = load16(kr + 16 * c);
        for (int64_t g = 0; g < kG; ++g) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh + g * kD), kv[0]);
          for (int64_t c = 1; c < kQV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * kD + 16 * c), kv[c], a);
          part[g][u] = a;
        }
      } else {
        for (int64_t g = 0; g < kG; ++g) part[g][u] = _mm512_setzero_ps();
      }
    }
    for (int64_t g = 0; g < kG; ++g) x[g][j] = reduce4(part[g][0], part[g][1], part[g][2], part[g][3]);
  }
  for (int64_t g = 0; g < kG; ++g) {
    out[g] = reduce4x4(x[g][0], x[g][1], x[g][2], x[g][3]);
    if (!kFull)
      out[g] = _mm512_mask_blend_ps(static_cast<__mmask16>((1u << nk) - 1),
                                    _mm512_set1_ps(-std::numeric_limits<float>::infinity()), out[g]);
  }
}

// decode_kernel with AVX-512F, for kD % 16 == 0: the same tasks, prefetch and online softmax per block as the AVX2
// path (the blocks read in place, not copied first), but each key row is loaded (a float16 one converted by vcvtph2ps) once for the kG heads, the scores of
// 16 keys x kG heads come out of kG transpose-reduces (scores16; the softmax then runs on 16 lanes), and P.V
// accumulates into zmm tiles of kG x kVC x 16 dimensions, each value row loaded once per tile. A sequence's arithmetic depends only on its own
// inputs (batch invariant): the task split and the copy or in-place read change no operation or order.
template <typename T, int64_t kD, int64_t kG>
void decode_kernel_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& bt_c, const torch::Tensor& sl_c, double scale, torch::Tensor& out) {
  static_assert(kD % 16 == 0, "head size must be a multiple of 16");
  constexpr int64_t kQV = kD / 16;
  constexpr int64_t kVC0 = kQV < 16 / kG ? kQV : 16 / kG > 0 ? 16 / kG : 1;  // <= 16 accumulators of 16 lanes
  constexpr int64_t kVC = kQV % kVC0 == 0 ? kVC0 : 1;
  const int64_t N = q.size(0), H = q.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = bt_c.size(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = bt_c.data_ptr<int64_t>();
  const int64_t* sl = sl_c.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row = KVH * kD;  // elements between consecutive tokens of one KV head
  const int64_t padded = (BS + 15) / 16 * 16;

  DecodeSplit split(sl, N, KVH, kG, kD, BS, true);
  const int64_t hpt = split.hpt;
  leanserve::SpinPool::parallel_for(split.size(), split.grain, [&](int64_t begin, int64_t end) {
    const int64_t state = hpt * kG * kD;
    std::vector<float> qs(state), acc(state), s(kG * padded);
    std::vector<float> m(hpt * kG), l(hpt * kG), corr(kG);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto& task = split.tasks[idx];
      const int64_t n = task.n, h0 = task.h0;
      const float* qn = qp + (n * H + h0 * kG) * kD;
      for (int64_t i = 0; i < state; ++i) {
        qs[i] = qn[i] * sc;
        acc[i] = 0.f;
      }
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = sl[n];
      for (int64_t j = task.jb; j < task.je; ++j) {
        const int64_t cnt = std::min(BS, len - j * BS);
        const DecodeSplit::BlockRef next =
            block_ahead(split, kp, vp, idx, begin, end, j, bt, MB, sl, BS, row, hpt * kD);
        const T* kblk = kp + bt[n * MB + j] * BS * row + h0 * kD;
        const T* vblk = vp + bt[n * MB + j] * BS * row + h0 * kD;
        // (no copy into a local buffer, unlike the AVX2 path: read in place it measured 5-40% faster here)
        for (int64_t hh = 0; hh < hpt; ++hh) {
          const T* kb = kblk + hh * kD;
          const T* vb = vblk + hh * kD;
          const float* qh = qs.data() + hh * kG * kD;
          float* ah = acc.data() + hh * kG * kD;
          __m512 mx[kG];
          for (int64_t g = 0; g < kG; ++g) mx[g] = _mm512_set1_ps(neg_inf);
          for (int64_t t0 = 0; t0 < padded; t0 += 16) {  // scores, 16 keys x kG heads at a time
            const int64_t nk = std::min<int64_t>(16, cnt - t0);
            __m512 sv[kG];
            if (nk == 16) scores16<T, kD, kG, true>(qh, kb + t0 * row, row, 16, sv);
            else if (nk > 0) scores16<T, kD, kG, false>(qh, kb + t0 * row, row, nk, sv);
            else for (int64_t g = 0; g < kG; ++g) sv[g] = _mm512_set1_ps(neg_inf);
            for (int64_t g = 0; g < kG; ++g) {
              _mm512_storeu_ps(s.data() + g * padded + t0, sv[g]);
              mx[g] = _mm512_max_ps(mx[g], sv[g]);
            }
          }
          for (int64_t g = 0; g < kG; ++g) {  // online softmax update on 16 lanes
            float* sg = s.data() + g * padded;
            float& mg = m[hh * kG + g];
            const float new_m = std::max(mg, _mm512_reduce_max_ps(mx[g]));
            const __m512 nm = _mm512_set1_ps(new_m);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < padded; t0 += 16) {
              const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), nm));
              _mm512_storeu_ps(sg + t0, e);
              sum = _mm512_add_ps(sum, e);
            }
            const float c = std::exp(mg - new_m);  // 0 for the first block (m = -inf)
            l[hh * kG + g] = l[hh * kG + g] * c + _mm512_reduce_add_ps(sum);
            mg = new_m;
            corr[g] = c;
          }
          for (int64_t d0 = 0; d0 < kD; d0 += 16 * kVC) {  // acc[g, tile] = c_g acc[g, tile] + sum_t p[g, t] v[t, tile]
            __m512 a[kG][kVC];
            for (int64_t g = 0; g < kG; ++g) {
              const __m512 cv = _mm512_set1_ps(corr[g]);
              for (int64_t c = 0; c < kVC; ++c) a[g][c] = _mm512_mul_ps(cv, _mm512_loadu_ps(ah + g * kD + d0 + 16 * c));
            }
            const int64_t ahead = d0 == 0 ? next.cnt : 0;  // rows of the block ahead to prefetch, head hh's
            for (int64_t t = 0; t < cnt; ++t) {
              if (t < ahead) prefetch_row(kp, vp, next.base + t * row + hh * kD, kD);
              const T* vr = vb + t * row + d0;
              __m512 vv[kVC];
              for (int64_t c = 0; c < kVC; ++c) vv[c] = load16(vr + 16 * c);
              for (int64_t g = 0; g < kG; ++g) {
                const __m512 p = _mm512_set1_ps(s[g * padded + t]);
                for (int64_t c = 0; c < kVC; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
              }
            }
            for (int64_t g = 0; g < kG; ++g)
              for (int64_t c = 0; c < kVC; ++c) _mm512_storeu_ps(ah + g * kD + d0 + 16 * c, a[g][c]);
          }
        }
      }
      split.finish(idx, acc.data(), m.data(), l.data(), op + (n * H + h0 * kG) * kD);
    }
  });
  split.merge(op, H, kG);
}

}  // namespace
#define LS_DECODE_KERNEL decode_kernel_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define LS_DECODE_KERNEL decode_kernel_avx2
#else
#define LS_DECODE_KERNEL decode_kernel
#endif

template <typename T>
void dispatch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& bt_c, const torch::Tensor& sl_c, double scale, torch::Tensor& out) {
  const int64_t D = q.size(2), G = q.size(1) / k_cache.size(2);
  if (D == 64 && G == 3) LS_DECODE_KERNEL<T, 64, 3>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 64 && G == 4) LS_DECODE_KERNEL<T, 64, 4>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 128 && G == 4) LS_DECODE_KERNEL<T, 128, 4>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else if (D == 128 && G == 8) LS_DECODE_KERNEL<T, 128, 8>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else decode_kernel<T, 0, 0>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q must be float32");
  TORCH_CHECK((k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kFloat16) &&
              v_cache.dtype() == k_cache.dtype(), "the KV cache must be float32 or float16");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 tables");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3) &&
              q.size(1) % k_cache.size(2) == 0 && block_tables.size(0) == q.size(0) &&
              seq_lens.size(0) == q.size(0), "shape mismatch");
  auto bt_c = block_tables.contiguous();
  auto sl_c = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  if (k_cache.dtype() == torch::kFloat16) dispatch<at::Half>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  else dispatch<float>(q, k_cache, v_cache, bt_c, sl_c, scale, out);
  return out;
}
