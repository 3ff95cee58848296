// The order in which a head's staged micro-batches take the device: the one with the most tokens
// first. A batch cut with small first and last micro-batches (the Python bridge's cut) then ends
// on a small one, whose dH is copied back and sent soonest, rather than on whichever large one
// happened to take the device last; the step's drain is that much shorter. No waiter is passed
// over more than `max_bypass` times, so a small micro-batch waits for at most that many others
// however many large ones keep coming. (A head has three I/O slots, and micro-batches wait here
// staged, in one: the default lets a small one wait out every other one staged, twice.)
#ifndef LOSSHEAD_SERVER_ENGINE_COMPUTE_QUEUE_H_
#define LOSSHEAD_SERVER_ENGINE_COMPUTE_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace losshead::server {

class ComputeQueue {
 public:
  explicit ComputeQueue(int max_bypass = 4) : max_bypass_(max_bypass) {}
  ComputeQueue(const ComputeQueue&) = delete;
  ComputeQueue& operator=(const ComputeQueue&) = delete;

  // Held while its micro-batch runs; the next waiter is chosen when it is destroyed.
  class Turn {
   public:
    Turn(Turn&& other) noexcept : queue_(other.queue_) { other.queue_ = nullptr; }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    Turn& operator=(Turn&&) = delete;
    ~Turn();

   private:
    friend class ComputeQueue;
    explicit Turn(ComputeQueue* queue) : queue_(queue) {}
    ComputeQueue* queue_;
  };

  // Blocks until no turn is held and this caller is the waiter chosen: the one passed over
  // `max_bypass` times if any (the earliest such), else the one with the most tokens (the
  // earliest among equals).
  Turn Wait(int64_t tokens);

  // How many callers are waiting (for tests).
  size_t waiting() const;

 private:
  struct Waiter {
    int64_t tokens;
    int bypassed = 0;
  };
  // Whether `w` may take the turn now. Called by Await with mu_ held.
  bool Chosen(const Waiter* w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release();

  const int max_bypass_;
  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Waiter*> waiting_ ABSL_GUARDED_BY(mu_);  // in arrival order
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_COMPUTE_QUEUE_H_
