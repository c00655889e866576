// parallel_for: the kernels' one way to split work across cores.
//
// The range [0, n) is cut into chunks of a fixed size; the calling thread and its helpers take chunks from one
// atomic counter until none are left, and the caller returns once every chunk is done. A helper that starts late
// finds no chunk and returns without touching `body`'s captures (the shared state it holds is reference counted),
// so results never depend on who ran which chunk.
//
// The helpers are the kernels' own persistent workers (one per core the process may use, but one), which spin for a while after
// a job before they sleep: a decode step is a few hundred short kernel calls a few microseconds apart, and on two
// cores waking one of XLA's intra-op pool threads for each (a futex wake, a thread that then runs on the core the
// caller needs next) cost more than the work it took. A caller that finds the workers busy (another device's
// program, a nested call) uses XLA's pool as before. FUCINA_KERNEL_POOL=xla always uses XLA's pool;
// FUCINA_KERNEL_SPIN_US sets how long a worker spins before it sleeps (default 2000).
#pragma once

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace fucina {

struct ParallelState {
  std::function<void(int64_t, int64_t)> body;
  int64_t n = 0, per_chunk = 1, n_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) {
      body(c * per_chunk, std::min(n, (c + 1) * per_chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// How many parallel_for calls ran where (read by kernels.threads()): on the caller alone (one chunk), with the
// kernels' own workers, or with XLA's pool.
struct ParallelCounts {
  std::atomic<uint64_t> alone{0}, workers{0}, pool{0};
};
inline ParallelCounts& parallel_counts() {
  static ParallelCounts counts;
  return counts;
}

// The persistent workers, one per core of the process's affinity mask but the caller's. One job at a time: a caller
// owns them while `busy_` is held.
class Workers {
 public:
  static Workers* get() {
    // One set per process, never destroyed (exit does not wait on a sleeping worker); a forked child, whose threads
    // did not survive the fork, makes its own.
    Workers* w = current().load(std::memory_order_acquire);
    if (w != nullptr) return w;
    static std::mutex make;
    std::lock_guard<std::mutex> lock(make);
    w = current().load(std::memory_order_relaxed);
    if (w == nullptr) {
      static const int registered = pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); });
      (void)registered;
      w = new Workers();
      current().store(w, std::memory_order_release);
    }
    return w;
  }

  static bool enabled() {
    static const bool on = [] {
      const char* v = std::getenv("FUCINA_KERNEL_POOL");
      return v == nullptr || std::strcmp(v, "xla") != 0;
    }();
    return on;
  }

  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

  // Runs st on the caller and the workers; false (nothing run) when another caller owns them.
  bool run(const std::shared_ptr<ParallelState>& st) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    {
      std::lock_guard<std::mutex> lock(job_mutex_);
      job_ = st;
    }
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    st->run();
    // a worker still on a chunk: spin, then give the core away in case it is the one the worker needs
    for (int i = 0; st->done.load(std::memory_order_acquire) < st->n_chunks; ++i) {
      if (i < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  static std::atomic<Workers*>& current() {
    static std::atomic<Workers*> w{nullptr};
    return w;
  }

  // The cores this process may run on (its affinity mask, as taskset or a container sets it), at least 1.
  static int64_t cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }

  Workers() {
    const char* v = std::getenv("FUCINA_KERNEL_SPIN_US");
    spin_ = std::chrono::microseconds(v != nullptr ? std::atoll(v) : 2000);
    const int64_t n = cores() - 1;
    for (int64_t i = 0; i < n; ++i) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();
    }
  }

  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + spin_;
      uint64_t g;
      for (int i = 0; (g = generation_.load(std::memory_order_acquire)) == seen; ++i) {
        _mm_pause();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
        }
      }
      seen = g;
      std::shared_ptr<ParallelState> st;
      {
        std::lock_guard<std::mutex> lock(job_mutex_);
        st = job_;
      }
      if (st) st->run();
    }
  }

  std::chrono::microseconds spin_{2000};
  std::vector<std::thread> threads_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  std::mutex job_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::shared_ptr<ParallelState> job_;
};

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F&& body, int64_t chunks_per_thread = 4) {
  if (n <= 0) return;
  Workers* workers = Workers::enabled() ? Workers::get() : nullptr;
  const int64_t threads = workers ? workers->size() + 1 : std::max<int64_t>(1, pool.num_threads());
  auto st = std::make_shared<ParallelState>();
  st->body = std::forward<F>(body);
  st->n = n;
  st->per_chunk = std::max<int64_t>(1, n / (threads * chunks_per_thread));
  st->n_chunks = (n + st->per_chunk - 1) / st->per_chunk;
  ParallelCounts& counts = parallel_counts();
  if (st->n_chunks <= 1) {
    counts.alone.fetch_add(1, std::memory_order_relaxed);
    return st->run();
  }
  if (workers && workers->run(st)) {
    counts.workers.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  counts.pool.fetch_add(1, std::memory_order_relaxed);
  for (int64_t t = 1; t < std::min(threads, st->n_chunks); ++t) pool.Schedule([st] { st->run(); });
  st->run();
  while (st->done.load(std::memory_order_acquire) < st->n_chunks) std::this_thread::yield();
}

}  // namespace fucina
