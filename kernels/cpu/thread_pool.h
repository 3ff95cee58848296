// A fixed set of worker threads that run a static-partitioned parallel-for.
#ifndef LOSSHEAD_KERNELS_CPU_THREAD_POOL_H_
#define LOSSHEAD_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace losshead::kernels {

// Runs `fn(begin, end)` over [0, n) split into `threads()` contiguous ranges, one per thread (the
// caller runs the first). The split depends only on n and the thread count, so any per-range work
// that is itself deterministic gives the same result every run. Thread-safe: concurrent
// ParallelFor calls are serialized. `fn` must not call ParallelFor on the same pool.
class ThreadPool {
 public:
  // `threads` <= 1 runs everything in the calling thread.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int part);
  void RunPart(int part);

  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_THREAD_POOL_H_
