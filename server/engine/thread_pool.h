// A fixed pool of worker threads: micro-batches, pulls, pushes and head creation run here so that
// gRPC reactions never wait on compute or device copies.
#ifndef LOSSHEAD_SERVER_ENGINE_THREAD_POOL_H_
#define LOSSHEAD_SERVER_ENGINE_THREAD_POOL_H_

#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace losshead::server {

class ThreadPool {
 public:
  // `threads` <= 0: one per hardware thread, at least 2.
  explicit ThreadPool(int threads);
  ~ThreadPool();  // Shutdown()
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs `task` on a worker, in FIFO order of scheduling. Tasks scheduled after Shutdown began
  // still run if a worker is alive to take them (tasks may schedule follow-ups while draining).
  void Schedule(absl::AnyInvocable<void() &&> task);
  // Runs every queued task, then joins the workers. Idempotent.
  void Shutdown();

  size_t queue_depth() const;
  int size() const { return static_cast<int>(workers_.size()); }

 private:
  void WorkerLoop();

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_THREAD_POOL_H_
