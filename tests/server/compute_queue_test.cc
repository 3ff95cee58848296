#include "server/engine/compute_queue.h"

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

// Waiters on their own threads; each records its tokens when it gets the turn and keeps the turn
// until the test lets it go.
class Waiters {
 public:
  explicit Waiters(ComputeQueue& queue) : queue_(queue) {}
  ~Waiters() {
    for (auto& w : waiters_) {
      if (!w->release.HasBeenNotified()) w->release.Notify();
    }
    for (auto& w : waiters_) {
      if (w->thread.joinable()) w->thread.join();
    }
  }

  // Starts a waiter and returns once it waits in the queue (or holds the turn).
  void Add(int64_t tokens) {
    const size_t before = queue_.waiting();
    auto w = std::make_unique<Waiter>();
    Waiter* raw = w.get();
    raw->thread = std::thread([this, raw, tokens] {
      ComputeQueue::Turn turn = queue_.Wait(tokens);
      {
        absl::MutexLock lock(&mu_);
        order_.push_back(tokens);
      }
      raw->granted.Notify();
      raw->release.WaitForNotification();
    });
    while (queue_.waiting() == before && !raw->granted.HasBeenNotified()) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    waiters_.push_back(std::move(w));
  }
  // Waits for whoever holds the turn, lets it go, and waits until the next waiter (if any) holds
  // it: an Add that follows then counts a queue that stands still (while the turn passes, the
  // count falls by one and rises again with the new waiter, and Add could miss both).
  void ReleaseHolder() {
    for (;;) {
      for (auto& w : waiters_) {
        if (w->granted.HasBeenNotified() && !w->release.HasBeenNotified()) {
          w->release.Notify();
          w->thread.join();
          while (Ungranted() > 0 && !AnyHolder()) absl::SleepFor(absl::Milliseconds(1));
          return;
        }
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  size_t Ungranted() const {
    size_t count = 0;
    for (const auto& w : waiters_) count += !w->granted.HasBeenNotified();
    return count;
  }
  bool AnyHolder() const {
    for (const auto& w : waiters_) {
      if (w->granted.HasBeenNotified() && !w->release.HasBeenNotified()) return true;
    }
    return false;
  }
  std::vector<int64_t> order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }

 private:
  struct Waiter {
    std::thread thread;
    absl::Notification granted;
    absl::Notification release;
  };
  ComputeQueue& queue_;
  std::vector<std::unique_ptr<Waiter>> waiters_;
  absl::Mutex mu_;
  std::vector<int64_t> order_;
};

TEST(ComputeQueueTest, AFreeQueueGrantsAtOnce) {
  ComputeQueue queue;
  { ComputeQueue::Turn turn = queue.Wait(5); }
  ComputeQueue::Turn again = queue.Wait(1);  // the first turn was given back
  EXPECT_EQ(queue.waiting(), 0u);
}

TEST(ComputeQueueTest, WaitersTakeTheDeviceLargestFirst) {
  ComputeQueue queue(/*max_bypass=*/4);
  Waiters w(queue);
  w.Add(1);  // holds the turn while the others queue up
  w.Add(256);
  w.Add(1280);
  w.Add(512);
  w.Add(1280);  // equal to the other 1280, came later
  for (int i = 0; i < 5; ++i) w.ReleaseHolder();
  EXPECT_EQ(w.order(), (std::vector<int64_t>{1, 1280, 1280, 512, 256}));
  EXPECT_EQ(queue.waiting(), 0u);
}

// A small waiter passed over twice goes next, however many large ones are waiting.
TEST(ComputeQueueTest, NoWaiterIsPassedOverMoreThanTheBound) {
  ComputeQueue queue(/*max_bypass=*/2);
  Waiters w(queue);
  w.Add(1000);  // holds the turn
  w.Add(1);
  w.Add(1000);
  w.ReleaseHolder();  // a large one goes: the small one passed over once
  w.Add(1000);
  w.ReleaseHolder();  // another: passed over twice
  w.Add(1000);
  w.ReleaseHolder();  // the small one's turn now, before the last large one
  w.ReleaseHolder();
  w.ReleaseHolder();
  EXPECT_EQ(w.order(), (std::vector<int64_t>{1000, 1000, 1000, 1, 1000}));
}

}  // namespace
}  // namespace losshead::server
