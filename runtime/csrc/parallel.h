// The work-balanced parallel loop shared by the CPU kernels (runtime/csrc/*.cpp).
#pragma once
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace deepinfer_parallel {

// The cut points of `threads` contiguous runs of tasks of equal summed work (work[t] >= 0, the tasks' estimates).
inline std::vector<int64_t> equal_work_runs(const std::vector<int64_t>& work, int64_t threads) {
  const int64_t tasks = static_cast<int64_t>(work.size());
  std::vector<int64_t> cut(threads + 1, tasks);
  cut[0] = 0;
  int64_t total = 0;
  for (const int64_t w : work) total += w;
  int64_t done = 0, next = 1;
  for (int64_t t = 0; t < tasks && next < threads; ++t) {
    done += work[t];
    while (next < threads && done * threads >= total * next) cut[next++] = t + 1;
  }
  return cut;
}

// Runs tasks [0, cut.back()) on the intra-op threads. Thread i starts on its own contiguous run [cut[i], cut[i + 1])
// (the caller cuts the runs to equal estimated work, so each thread streams its own stretch of memory) and, once that
// is done, takes the tasks the other threads have not started yet, one at a time: the estimate is off by the rows'
// cache state, and the two threads of a 2-core VM do not run at the same speed. 2-core Zen 4 VM, the same build with
// and without the taking, weights out of cache: decode-sized expert groups and 16-row linears with bf16 dot products
// 1.01-1.08x, fp32 1.00-1.03x; the paged decode attention over 16 sequences of mixed lengths 1.08-1.14x (on top of
// the 1.2-1.55x of cutting its runs by keys rather than by tokens).
// make_worker() is called once on each thread and returns the callable that runs one task (it may own scratch).
template <typename MakeWorker>
void run_tasks(const std::vector<int64_t>& cut, const MakeWorker& make_worker) {
  const int64_t threads = static_cast<int64_t>(cut.size()) - 1;
  if (threads <= 0) return;
  struct alignas(64) Next {   // one cache line each: a thread bumps its own counter with no sharing until the end
    std::atomic<int64_t> t;
  };
  std::vector<Next> next(threads);
  for (int64_t i = 0; i < threads; ++i) next[i].t.store(cut[i], std::memory_order_relaxed);
  const auto drain = [&](int64_t begin, int64_t end) {
    auto work = make_worker();
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < threads; ++j) {   // its own run, then what is left of the next threads' runs
        const int64_t v = (i + j) % threads;
        for (int64_t t; (t = next[v].t.fetch_add(1, std::memory_order_relaxed)) < cut[v + 1];) work(t);
      }
  };
  if (threads == 1 || at::in_parallel_region()) return drain(0, threads);
  at::parallel_for(0, threads, 1, drain);
}

}  // namespace deepinfer_parallel
