#include "kernels/cpu/thread_pool.h"

namespace losshead::kernels {

ThreadPool::ThreadPool(int threads) {
  for (int part = 1; part < threads; ++part) {
    workers_.emplace_back([this, part] { WorkerLoop(part); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::RunPart(int part) {
  const int64_t parts = threads();
  const int64_t begin = n_ * part / parts;
  const int64_t end = n_ * (part + 1) / parts;
  if (begin < end) (*fn_)(begin, end);
}

void ThreadPool::WorkerLoop(int part) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunPart(part);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  // Small loops are not worth waking the workers for.
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  RunPart(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

}  // namespace losshead::kernels
