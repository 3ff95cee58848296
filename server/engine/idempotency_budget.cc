#include "server/engine/idempotency_budget.h"

#include <utility>

#include "absl/time/clock.h"
#include "server/engine/idempotency_cache.h"

namespace losshead::server {

absl::string_view IdempotencyBudget::CauseName(Cause cause) {
  switch (cause) {
    case Cause::kWindow:
      return "window";
    case Cause::kClientBytes:
      return "client_bytes";
    case Cause::kServerBytes:
      return "server_bytes";
    case Cause::kAge:
      return "age";
  }
  return "unknown";
}

IdempotencyBudget::IdempotencyBudget(Limits limits, std::function<absl::Time()> clock)
    : limits_(limits), clock_(clock != nullptr ? std::move(clock) : [] { return absl::Now(); }) {}

IdempotencyBudget::~IdempotencyBudget() {
  if (!expiry_.joinable()) return;
  stop_.Notify();
  expiry_.join();
}

void IdempotencyBudget::StartExpiry(absl::Duration period) {
  if (expiry_.joinable()) return;
  expiry_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) Expire();
  });
}

IdempotencyBudget::Usage IdempotencyBudget::usage() const {
  absl::MutexLock lock(&mu_);
  return Usage{.results = order_.size(), .bytes = bytes_, .evictions = evictions_};
}

void IdempotencyBudget::Expire() {
  absl::MutexLock lock(&mu_);
  EnforceLocked();
}

IdempotencyBudget::Order::iterator IdempotencyBudget::AddLocked(IdempotencyCache* cache,
                                                                const std::string& client_id,
                                                                uint64_t sequence, size_t bytes) {
  bytes_ += bytes;
  return order_.insert(order_.end(), Remembered{.cache = cache,
                                                .client_id = client_id,
                                                .sequence = sequence,
                                                .bytes = bytes,
                                                .at = clock_()});
}

void IdempotencyBudget::ReleaseLocked(Order::iterator it) {
  bytes_ -= it->bytes;
  order_.erase(it);
}

void IdempotencyBudget::EnforceLocked() {
  if (order_.empty()) return;
  const absl::Time now = clock_();
  while (!order_.empty()) {
    const Remembered& oldest = order_.front();
    Cause cause;
    if (limits_.ttl != absl::InfiniteDuration() && now - oldest.at >= limits_.ttl) {
      cause = Cause::kAge;
    } else if (bytes_ > limits_.total_bytes && order_.size() > 1) {
      cause = Cause::kServerBytes;
    } else {
      return;  // the rest is younger, and within the bytes
    }
    // The cache releases it (ReleaseLocked) as it lets it go: `oldest` is gone afterwards, hence
    // the copies.
    IdempotencyCache* const cache = oldest.cache;
    const std::string client_id = oldest.client_id;
    const uint64_t sequence = oldest.sequence;
    if (!cache->EvictLocked(client_id, sequence, cause)) {
      ReleaseLocked(order_.begin());  // not the cache's any more (cannot happen)
    }
  }
}

}  // namespace losshead::server
