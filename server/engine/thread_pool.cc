#include "server/engine/thread_pool.h"

#include <algorithm>
#include <utility>

namespace losshead::server {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() { Shutdown(); }

void ThreadPool::Schedule(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void ThreadPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

size_t ThreadPool::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void ThreadPool::WorkerLoop() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace losshead::server
