#include "server/engine/idempotency_cache.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {

absl::StatusOr<std::shared_ptr<const StepOutcome>> IdempotencyCache::Begin(
    const std::string& client_id, uint64_t sequence, const StepFingerprint& fingerprint) {
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
      auto entry = std::make_shared<Entry>();
      entry->fingerprint = fingerprint;
      client.entries.emplace(sequence, std::move(entry));
      return std::shared_ptr<const StepOutcome>();  // claimed: the caller computes
    }
    std::shared_ptr<Entry> entry = it->second;
    // Checked before waiting too: a different micro-batch must not wait for, nor be answered by,
    // the one that holds its key.
    if (entry->fingerprint.has_value() && *entry->fingerprint != fingerprint) {
      return absl::AlreadyExistsError(absl::StrCat(
          "sequence ", sequence, " of client '", client_id,
          "' was already used for a different micro-batch (this one differs in ",
          StepDifferences(*entry->fingerprint, fingerprint),
          "); a retry must resend the same micro-batch and a new one needs a new sequence; "
          "nothing was counted"));
    }
    if (entry->done) return entry->outcome;
    // The original is computing on another worker: wait for it rather than compute twice.
    mu_.Await(absl::Condition(
        +[](Entry* e) { return e->done || e->abandoned; }, entry.get()));
    if (entry->done) return entry->outcome;
    // Abandoned: the original failed; look again (this caller will usually claim it).
  }
}

void IdempotencyCache::Complete(const std::string& client_id, uint64_t sequence,
                                std::shared_ptr<StepOutcome> outcome) {
  absl::MutexLock lock(&mu_);
  SettleLocked(client_id, sequence, std::move(outcome));
}

void IdempotencyCache::Fail(const std::string& client_id, uint64_t sequence, absl::Status failure) {
  auto outcome = std::make_shared<StepOutcome>();
  outcome->failure = std::move(failure);
  absl::MutexLock lock(&mu_);
  SettleLocked(client_id, sequence, std::move(outcome));
}

void IdempotencyCache::SettleLocked(const std::string& client_id, uint64_t sequence,
                                    std::shared_ptr<StepOutcome> outcome) {
  Client& client = clients_[client_id];
  auto it = client.entries.find(sequence);
  if (it == client.entries.end() || it->second->done) return;
  outcome->fingerprint = it->second->fingerprint;
  client.done_bytes += outcome->bytes();
  client.done_count += 1;
  it->second->outcome = std::move(outcome);
  it->second->done = true;
  if (!client.max_applied.has_value() || sequence > *client.max_applied) {
    client.max_applied = sequence;
  }
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

std::optional<uint64_t> IdempotencyCache::max_applied(const std::string& client_id) const {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return std::nullopt;
  return it->second.max_applied;
}

std::vector<ClientCheckpoint> IdempotencyCache::Export() const {
  std::vector<ClientCheckpoint> out;
  absl::MutexLock lock(&mu_);
  out.reserve(clients_.size());
  for (const auto& [id, client] : clients_) {
    ClientCheckpoint c{.client_id = id,
                       .max_evicted = client.max_evicted,
                       .max_applied = client.max_applied};
    for (const auto& [sequence, entry] : client.entries) {
      if (entry->done) c.results.emplace_back(sequence, entry->outcome);
    }
    // A client id whose only trace is an abandoned or running claim has nothing to restore.
    if (c.max_evicted || c.max_applied || !c.results.empty()) out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.client_id < b.client_id; });
  return out;
}

void IdempotencyCache::Import(const std::vector<ClientCheckpoint>& clients) {
  absl::MutexLock lock(&mu_);
  clients_.clear();
  for (const ClientCheckpoint& c : clients) {
    Client& client = clients_[c.client_id];
    client.max_evicted = c.max_evicted;
    client.max_applied = c.max_applied;
    for (const auto& [sequence, outcome] : c.results) {
      auto entry = std::make_shared<Entry>();
      entry->done = true;
      entry->fingerprint = outcome->fingerprint;
      entry->outcome = outcome;
      client.done_bytes += outcome->bytes();
      client.done_count += 1;
      client.entries.emplace(sequence, std::move(entry));
    }
    // A smaller window or byte cap than the checkpoint's server had applies from now on.
    EvictLocked(client);
  }
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
