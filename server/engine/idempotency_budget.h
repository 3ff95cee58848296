// The server-wide bound on the micro-batch results that the heads' idempotency caches remember
// (IdempotencyCache): their bytes over every head and client id, and their age. One budget is
// shared by the heads of a server (HeadOptions::idempotency_budget); each cache keeps its own
// per-client window and byte cap besides.
//
// Results leave in the order they were remembered, oldest first: those older than `ttl` (cause
// kAge), then, while the remembered bytes exceed `total_bytes`, the oldest ones (kServerBytes).
// The result remembered last is never evicted for bytes, so that the answer of the micro-batch
// that just completed can always be asked for again (the bytes may pass `total_bytes` by that one
// result). An evicted result leaves its client id's floor behind: a repeat of its sequence is
// FAILED_PRECONDITION naming the eviction and is never computed again (idempotency_cache.h).
//
// Each remembered result counts StepOutcome::bytes() (dH, per-token losses and its
// bookkeeping). Its age counts from when this process remembered it: a result restored from a
// checkpoint starts afresh at the restore.
//
// One mutex guards the budget and the state of every cache that shares it, so that a result of
// one head can be evicted to make room for another's without any lock order between heads. Its
// critical sections are map and list operations: no tensor is copied and no device waited for
// under it. Thread-safe.
#ifndef LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_BUDGET_H_
#define LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_BUDGET_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace losshead::server {

class IdempotencyCache;

class IdempotencyBudget {
 public:
  // Why a remembered result was let go.
  enum class Cause {
    kWindow = 0,   // more than the window's results for its (head, client id)
    kClientBytes,  // its (head, client id)'s results held more than their byte cap
    kServerBytes,  // the server's results held more than total_bytes
    kAge,          // older than ttl
  };
  static constexpr size_t kCauses = 4;
  // "window", "client_bytes", "server_bytes", "age" (metric labels).
  static absl::string_view CauseName(Cause cause);

  struct Limits {
    size_t total_bytes = std::numeric_limits<size_t>::max();
    absl::Duration ttl = absl::InfiniteDuration();  // > 0
  };
  struct Usage {
    size_t results = 0;
    size_t bytes = 0;
    std::array<uint64_t, kCauses> evictions{};  // since the start, by Cause
  };

  // `clock` (tests): the time ages are measured with; absl::Now when null.
  explicit IdempotencyBudget(Limits limits, std::function<absl::Time()> clock = nullptr);
  ~IdempotencyBudget();  // stops StartExpiry's thread
  IdempotencyBudget(const IdempotencyBudget&) = delete;
  IdempotencyBudget& operator=(const IdempotencyBudget&) = delete;

  const Limits& limits() const { return limits_; }
  Usage usage() const;
  // Evicts the results older than the ttl now. The caches do so whenever they are used; the server
  // calls this periodically as well, so that an idle server lets them go too.
  void Expire();
  // Calls Expire every `period` on a thread of its own, until the budget is destroyed. Once.
  void StartExpiry(absl::Duration period);

 private:
  friend class IdempotencyCache;

  // One remembered result, in the order of `order_`.
  struct Remembered {
    IdempotencyCache* cache;
    std::string client_id;
    uint64_t sequence;
    size_t bytes;
    absl::Time at;
  };
  using Order = std::list<Remembered>;

  // Accounts for a result that `cache` now remembers; the handle is the cache's to Release.
  Order::iterator AddLocked(IdempotencyCache* cache, const std::string& client_id,
                            uint64_t sequence, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cache no longer remembers the result: evicted for `cause`, or (none) forgotten with its
  // head or replaced by an import.
  void ReleaseLocked(Order::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountLocked(Cause cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++evictions_[static_cast<size_t>(cause)];
  }
  // Evicts, through their caches, the results past the ttl and those beyond total_bytes.
  void EnforceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  const std::function<absl::Time()> clock_;
  absl::Notification stop_;
  std::thread expiry_;
  mutable absl::Mutex mu_;
  Order order_ ABSL_GUARDED_BY(mu_);  // oldest first
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::array<uint64_t, kCauses> evictions_ ABSL_GUARDED_BY(mu_){};
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_BUDGET_H_
