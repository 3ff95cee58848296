#include "server/engine/compute_queue.h"

#include <algorithm>

namespace losshead::server {

ComputeQueue::Turn::~Turn() {
  if (queue_ != nullptr) queue_->Release();
}

ComputeQueue::Turn ComputeQueue::Wait(int64_t tokens) {
  Waiter me{.tokens = tokens};
  struct Ask {
    const ComputeQueue* queue;
    const Waiter* waiter;
  } ask{this, &me};
  absl::MutexLock lock(&mu_);
  waiting_.push_back(&me);
  mu_.Await(absl::Condition(
      +[](Ask* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->queue->Chosen(a->waiter); }, &ask));
  busy_ = true;
  const auto mine = std::find(waiting_.begin(), waiting_.end(), &me);
  // Everyone who came earlier was passed over once more.
  for (auto it = waiting_.begin(); it != mine; ++it) ++(*it)->bypassed;
  waiting_.erase(mine);
  return Turn(this);
}

bool ComputeQueue::Chosen(const Waiter* w) const {
  if (busy_) return false;
  const Waiter* best = nullptr;
  for (const Waiter* candidate : waiting_) {
    if (candidate->bypassed >= max_bypass_) return candidate == w;  // the earliest overdue one
    if (best == nullptr || candidate->tokens > best->tokens) best = candidate;
  }
  return best == w;
}

void ComputeQueue::Release() {
  absl::MutexLock lock(&mu_);
  busy_ = false;
}

size_t ComputeQueue::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_.size();
}

}  // namespace losshead::server
