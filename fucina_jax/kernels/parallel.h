// parallel_for on XLA's intra-op thread pool (the FFI ThreadPool context of a CPU handler).
//
// The range [0, n) is cut into chunks of a fixed size; the calling thread and up to num_threads - 1 pool tasks take
// chunks from one atomic counter until none are left, and the caller returns once every chunk is done. A pool task
// that starts late finds no chunk and returns without touching `body`'s captures (the shared state it holds is
// reference counted), so nothing waits on a busy pool, and results never depend on who ran which chunk.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

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

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F&& body, int64_t chunks_per_thread = 4) {
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto st = std::make_shared<ParallelState>();
  st->body = std::forward<F>(body);
  st->n = n;
  st->per_chunk = std::max<int64_t>(1, n / (threads * chunks_per_thread));
  st->n_chunks = (n + st->per_chunk - 1) / st->per_chunk;
  for (int64_t t = 1; t < std::min(threads, st->n_chunks); ++t) pool.Schedule([st] { st->run(); });
  st->run();
  while (st->done.load(std::memory_order_acquire) < st->n_chunks) std::this_thread::yield();
}

}  // namespace fucina
