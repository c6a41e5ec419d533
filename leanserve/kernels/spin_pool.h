// A small fork-join thread pool for leanserve's kernels whose workers spin briefly before sleeping.
//
// Why not at::parallel_for (OpenMP): leanserve runs OpenMP with OMP_WAIT_POLICY=PASSIVE (so that NumPy's BLAS
// threads and torch's OpenMP threads can share the cores; see leanserve/__init__.py), and then every parallel region
// pays a futex wake-up of ~40 us on this 2-core VM -- more than a whole 576x576 4-bit matrix-vector product takes
// on one core. A decode step runs ~200 kernel calls a few microseconds apart, so here the workers spin for up to
// kSpinMicros after each job (catching the next call at once) and then sleep on a futex (std::atomic::wait), so an
// idle engine costs no CPU. Like ggml's thread pool, which llama.cpp uses for the same reason.
//
// parallel_for(n, grain, fn, spin) calls fn(begin, end) on contiguous ranges covering [0, n), the caller taking the first
// range; it returns when all are done. Work below 2 * grain, a pool of one thread, or a call while another thread
// holds the pool runs serially on the caller. The pool has at::get_num_threads() threads (rebuilt when that changes)
// and is rebuilt in a forked child (whose workers do not exist).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LS_CPU_RELAX() _mm_pause()
#else
#define LS_CPU_RELAX() std::this_thread::yield()
#endif

namespace leanserve {

class SpinPool {
 public:
  static constexpr int64_t kSpinMicros = 50;

  // spin: whether the workers spin for the next job after this one (decode kernels, called a few microseconds
  // apart) or go straight to sleep (work that a BLAS or OpenMP call follows, whose threads need the cores).
  template <class F>
  static void parallel_for(int64_t n, int64_t grain, const F& fn, bool spin = true) {
    if (n <= 0) return;
    const int threads = at::get_num_threads();
    if (threads <= 1 || n < 2 * std::max<int64_t>(grain, 1)) {
      fn(0, n);
      return;
    }
    SpinPool* pool = instance(threads);
    std::unique_lock<std::mutex> lock(pool->busy_, std::try_to_lock);
    if (!lock.owns_lock()) {  // another thread is using the pool: do the work here
      fn(0, n);
      return;
    }
    const int64_t parts = std::min<int64_t>(threads, (n + grain - 1) / grain);
    pool->run(n, parts, [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &fn,
              spin);
  }

  ~SpinPool() {
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  using Call = void (*)(const void*, int64_t, int64_t);

  explicit SpinPool(int threads) : threads_(threads), pid_(getpid()) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  static SpinPool* instance(int threads) {
    static std::mutex m;
    static SpinPool* pool = nullptr;  // intentionally leaked at exit: joining threads during teardown can hang
    std::lock_guard<std::mutex> guard(m);
    if (pool != nullptr && pool->pid_ != getpid()) pool = nullptr;  // forked child: the workers are gone (leak)
    if (pool == nullptr || pool->threads_ != threads) {
      delete pool;
      pool = new SpinPool(threads);
    }
    return pool;
  }

  static void range(int64_t n, int64_t parts, int64_t i, int64_t* b, int64_t* e) {
    *b = n * i / parts;
    *e = n * (i + 1) / parts;
  }

  void run(int64_t n, int64_t parts, Call call, const void* ctx, bool spin) {
    spin_ = spin;
    n_ = n;
    parts_ = parts;
    call_ = call;
    ctx_ = ctx;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    int64_t b, e;
    range(n, parts, 0, &b, &e);
    call(ctx, b, e);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 4096) {
        LS_CPU_RELAX();
      } else {
        std::this_thread::yield();  // a worker was descheduled: let it (or whoever holds its core) run
      }
    }
  }

  void work(int index) {
    uint64_t seen = 0;  // the generation at construction: a job posted before this thread started still counts
    bool spin = false;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t now = seen;
      for (int spins = 0; (now = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
        if (!spin || ((spins & 255) == 255 && std::chrono::steady_clock::now() - start >
                                                   std::chrono::microseconds(kSpinMicros))) {
          generation_.wait(seen, std::memory_order_acquire);  // sleep until the next job
        } else {
          std::this_thread::yield();  // a runnable thread (BLAS, OpenMP) that wants this core gets it
        }
      }
      seen = now;
      if (stop_.load(std::memory_order_acquire)) return;
      if (index < parts_) {
        int64_t b, e;
        range(n_, parts_, index, &b, &e);
        call_(ctx_, b, e);
      }
      spin = spin_;  // read before signalling: the next job may rewrite it
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  int64_t n_ = 0, parts_ = 0;
  bool spin_ = true;
  Call call_ = nullptr;
  const void* ctx_ = nullptr;
};

}  // namespace leanserve
