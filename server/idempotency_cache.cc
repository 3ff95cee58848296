#include "server/idempotency_cache.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {

absl::StatusOr<std::shared_ptr<const StepOutcome>> IdempotencyCache::Begin(
    const std::string& client_id, uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  while (true) {
    Client& client = clients_[client_id];
    auto it = client.entries.find(sequence);
    if (it == client.entries.end()) {
      if (client.max_evicted.has_value() && sequence <= *client.max_evicted) {
        return absl::FailedPreconditionError(
            absl::StrCat("sequence ", sequence, " of client '", client_id,
                         "' is outside the replay window (sequences <= ", *client.max_evicted,
                         " are no longer remembered); it may already be counted"));
      }
      client.entries.emplace(sequence, std::make_shared<Entry>());
      return std::shared_ptr<const StepOutcome>();  // claimed: the caller computes
    }
    std::shared_ptr<Entry> entry = it->second;
    if (entry->done) return entry->outcome;
    // The original is computing on another worker: wait for it rather than compute twice.
    mu_.Await(absl::Condition(
        +[](Entry* e) { return e->done || e->abandoned; }, entry.get()));
    if (entry->done) return entry->outcome;
    // Abandoned: the original failed; look again (this caller will usually claim it).
  }
}

void IdempotencyCache::Complete(const std::string& client_id, uint64_t sequence,
                                std::shared_ptr<const StepOutcome> outcome) {
  absl::MutexLock lock(&mu_);
  Client& client = clients_[client_id];
  auto it = client.entries.find(sequence);
  if (it == client.entries.end() || it->second->done) return;
  client.done_bytes += outcome->bytes();
  client.done_count += 1;
  it->second->outcome = std::move(outcome);
  it->second->done = true;
  EvictLocked(client);
}

void IdempotencyCache::Abandon(const std::string& client_id, uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  Client& client = clients_[client_id];
  auto it = client.entries.find(sequence);
  if (it == client.entries.end() || it->second->done) return;
  it->second->abandoned = true;
  client.entries.erase(it);
}

size_t IdempotencyCache::remembered(const std::string& client_id) const {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client_id);
  return it == clients_.end() ? 0 : it->second.done_count;
}

void IdempotencyCache::EvictLocked(Client& client) {
  auto over = [&] {
    return client.done_count > window_ ||
           (client.done_bytes > max_bytes_per_client_ && client.done_count > 1);
  };
  auto it = client.entries.begin();
  while (over() && it != client.entries.end()) {
    if (!it->second->done) {  // claims in progress are not results yet
      ++it;
      continue;
    }
    client.done_bytes -= it->second->outcome->bytes();
    client.done_count -= 1;
    if (!client.max_evicted.has_value() || it->first > *client.max_evicted) {
      client.max_evicted = it->first;
    }
    it = client.entries.erase(it);
  }
}

}  // namespace losshead::server
