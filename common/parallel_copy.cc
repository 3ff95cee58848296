#include "common/parallel_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace losshead {
namespace {

// One copy, cut into pieces that whoever holds the job takes in turn.
struct Job {
  char* dst = nullptr;
  const char* src = nullptr;
  size_t bytes = 0;
  size_t pieces = 0;
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  size_t done ABSL_GUARDED_BY(mu) = 0;

  // Copies pieces until none is left to take, then counts them done.
  void Drain() {
    size_t copied = 0;
    for (size_t i = next.fetch_add(1); i < pieces; i = next.fetch_add(1), ++copied) {
      const size_t at = i * kParallelCopyPieceBytes;
      std::memcpy(dst + at, src + at, std::min(kParallelCopyPieceBytes, bytes - at));
    }
    if (copied == 0) return;
    absl::MutexLock lock(&mu);
    done += copied;
  }
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == pieces; }
};

// The helper threads, and the jobs offered to them. Never destroyed: a helper may still be
// waiting for work while the process exits.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();
    return *helpers;
  }

  // Hands `job` to as many idle helpers as it has pieces beyond the caller's first (at most).
  void Offer(const std::shared_ptr<Job>& job) {
    absl::MutexLock lock(&mu_);
    const size_t wanted = std::min<size_t>(idle_, job->pieces - 1);
    for (size_t i = 0; i < wanted; ++i) jobs_.push_back(job);
    idle_ -= wanted;
  }

 private:
  Helpers() {
    for (int i = 0; i < kParallelCopyHelpers; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        absl::MutexLock lock(&mu_);
        ++idle_;
        mu_.Await(absl::Condition(
            +[](std::deque<std::shared_ptr<Job>>* jobs) { return !jobs->empty(); }, &jobs_));
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job->Drain();
    }
  }

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Helpers waiting for a job and not yet handed one.
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

void ParallelCopy(void* dst, const void* src, size_t bytes) {
  if (bytes < kParallelCopyMinBytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  auto job = std::make_shared<Job>();
  job->dst = static_cast<char*>(dst);
  job->src = static_cast<const char*>(src);
  job->bytes = bytes;
  job->pieces = (bytes + kParallelCopyPieceBytes - 1) / kParallelCopyPieceBytes;
  Helpers::Get().Offer(job);
  job->Drain();
  // The pieces helpers took are under way: wait for them (a piece is 2 MiB, well under 1 ms).
  absl::MutexLock lock(&job->mu);
  job->mu.Await(absl::Condition(job.get(), &Job::AllDone));
}

}  // namespace losshead
