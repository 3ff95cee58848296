#include "server/engine/idempotency_cache.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace losshead::server {

IdempotencyCache::IdempotencyCache(size_t window, size_t max_bytes_per_client,
                                   std::shared_ptr<IdempotencyBudget> budget)
    : window_(window),
      max_bytes_per_client_(max_bytes_per_client),
      budget_(budget != nullptr
                  ? std::move(budget)
                  : std::make_shared<IdempotencyBudget>(IdempotencyBudget::Limits())) {}

IdempotencyCache::~IdempotencyCache() {
  absl::MutexLock lock(&mu());
  ClearLocked();
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> IdempotencyCache::Begin(
    const std::string& client_id, uint64_t sequence, const StepFingerprint& fingerprint) {
  absl::MutexLock lock(&mu());
  budget_->EnforceLocked();  // a result past the ttl is not replayed
  while (true) {
    Client& client = clients_[client_id];
    auto it = client.entries.find(sequence);
    if (it == client.entries.end()) {
      if (client.max_evicted.has_value() && sequence <= *client.max_evicted) {
        return EvictedError(client_id, sequence, client);
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
    mu().Await(absl::Condition(
        +[](Entry* e) { return e->done || e->abandoned; }, entry.get()));
    if (entry->done) return entry->outcome;
    // Abandoned: the original failed; look again (this caller will usually claim it).
  }
}

absl::Status IdempotencyCache::EvictedError(const std::string& client_id, uint64_t sequence,
                                            const Client& client) const {
  // Every cause whose evictions span this sequence may have evicted it.
  std::vector<std::string> causes;
  for (size_t c = 0; c < IdempotencyBudget::kCauses; ++c) {
    const std::optional<EvictedRange>& range = client.evicted_by[c];
    if (!range.has_value() || sequence < range->lowest || sequence > range->highest) continue;
    switch (static_cast<Cause>(c)) {
      case Cause::kWindow:
        causes.push_back(absl::StrCat("outside the replay window of ", window_,
                                      " results per client id (--idempotency_window)"));
        break;
      case Cause::kClientBytes:
        causes.push_back(absl::StrCat("the client id's results held more than ",
                                      max_bytes_per_client_, " bytes (--idempotency_max_bytes)"));
        break;
      case Cause::kServerBytes:
        causes.push_back(absl::StrCat("the server's remembered results held more than ",
                                      budget_->limits().total_bytes,
                                      " bytes (--idempotency_total_bytes)"));
        break;
      case Cause::kAge:
        causes.push_back(absl::StrCat("older than ", absl::FormatDuration(budget_->limits().ttl),
                                      " (--idempotency_ttl)"));
        break;
    }
  }
  if (client.restored_floor.has_value() && sequence <= *client.restored_floor) {
    causes.push_back("before the server's last restart");
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "sequence ", sequence, " of client '", client_id,
      "' is no longer remembered: its result was evicted (", absl::StrJoin(causes, "; or "),
      "; sequences <= ", *client.max_evicted,
      " are no longer remembered); it may already be counted, so it is not computed again"));
}

void IdempotencyCache::Complete(const std::string& client_id, uint64_t sequence,
                                std::shared_ptr<StepOutcome> outcome) {
  absl::MutexLock lock(&mu());
  SettleLocked(client_id, sequence, std::move(outcome));
}

void IdempotencyCache::Fail(const std::string& client_id, uint64_t sequence, absl::Status failure) {
  auto outcome = std::make_shared<StepOutcome>();
  outcome->failure = std::move(failure);
  absl::MutexLock lock(&mu());
  SettleLocked(client_id, sequence, std::move(outcome));
}

void IdempotencyCache::SettleLocked(const std::string& client_id, uint64_t sequence,
                                    std::shared_ptr<StepOutcome> outcome) {
  Client& client = clients_[client_id];
  auto it = client.entries.find(sequence);
  if (it == client.entries.end() || it->second->done) return;
  Entry& entry = *it->second;
  outcome->fingerprint = entry.fingerprint;
  const size_t bytes = outcome->bytes();
  client.done_bytes += bytes;
  client.done_count += 1;
  entry.outcome = std::move(outcome);
  entry.done = true;
  entry.remembered = budget_->AddLocked(this, client_id, sequence, bytes);
  if (!client.max_applied.has_value() || sequence > *client.max_applied) {
    client.max_applied = sequence;
  }
  TrimLocked(client);
  budget_->EnforceLocked();
}

void IdempotencyCache::Abandon(const std::string& client_id, uint64_t sequence) {
  absl::MutexLock lock(&mu());
  Client& client = clients_[client_id];
  auto it = client.entries.find(sequence);
  if (it == client.entries.end() || it->second->done) return;
  it->second->abandoned = true;
  client.entries.erase(it);
}

size_t IdempotencyCache::remembered(const std::string& client_id) const {
  absl::MutexLock lock(&mu());
  auto it = clients_.find(client_id);
  return it == clients_.end() ? 0 : it->second.done_count;
}

std::optional<uint64_t> IdempotencyCache::max_applied(const std::string& client_id) const {
  absl::MutexLock lock(&mu());
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return std::nullopt;
  return it->second.max_applied;
}

std::vector<ClientCheckpoint> IdempotencyCache::Export() {
  std::vector<ClientCheckpoint> out;
  absl::MutexLock lock(&mu());
  budget_->EnforceLocked();
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
  absl::MutexLock lock(&mu());
  ClearLocked();
  for (const ClientCheckpoint& c : clients) {
    Client& client = clients_[c.client_id];
    client.max_evicted = c.max_evicted;
    client.restored_floor = c.max_evicted;
    client.max_applied = c.max_applied;
    for (const auto& [sequence, outcome] : c.results) {
      auto entry = std::make_shared<Entry>();
      entry->done = true;
      entry->fingerprint = outcome->fingerprint;
      entry->outcome = outcome;
      const size_t bytes = outcome->bytes();
      client.done_bytes += bytes;
      client.done_count += 1;
      entry->remembered = budget_->AddLocked(this, c.client_id, sequence, bytes);
      client.entries.emplace(sequence, std::move(entry));
    }
    // A smaller window or byte cap than the checkpoint's server had applies from now on.
    TrimLocked(client);
  }
  // And so does the server-wide budget, over what the heads restored so far.
  budget_->EnforceLocked();
}

void IdempotencyCache::TrimLocked(Client& client) {
  auto it = client.entries.begin();
  while (it != client.entries.end()) {
    Cause cause;
    if (client.done_count > window_) {
      cause = Cause::kWindow;
    } else if (client.done_bytes > max_bytes_per_client_ && client.done_count > 1) {
      cause = Cause::kClientBytes;
    } else {
      return;
    }
    if (!it->second->done) {  // claims in progress are not results yet
      ++it;
      continue;
    }
    auto next = std::next(it);
    EvictEntryLocked(client, it, cause);
    it = next;
  }
}

void IdempotencyCache::EvictEntryLocked(Client& client,
                                        std::map<uint64_t, std::shared_ptr<Entry>>::iterator it,
                                        Cause cause) {
  const uint64_t sequence = it->first;
  client.done_bytes -= it->second->outcome->bytes();
  client.done_count -= 1;
  if (!client.max_evicted.has_value() || sequence > *client.max_evicted) {
    client.max_evicted = sequence;
  }
  std::optional<EvictedRange>& range = client.evicted_by[static_cast<size_t>(cause)];
  if (!range.has_value()) {
    range = EvictedRange{.lowest = sequence, .highest = sequence};
  } else {
    range->lowest = std::min(range->lowest, sequence);
    range->highest = std::max(range->highest, sequence);
  }
  budget_->ReleaseLocked(it->second->remembered);
  budget_->CountLocked(cause);
  client.entries.erase(it);
}

bool IdempotencyCache::EvictLocked(const std::string& client_id, uint64_t sequence, Cause cause) {
  auto client = clients_.find(client_id);
  if (client == clients_.end()) return false;
  auto it = client->second.entries.find(sequence);
  if (it == client->second.entries.end() || !it->second->done) return false;
  EvictEntryLocked(client->second, it, cause);
  return true;
}

void IdempotencyCache::ClearLocked() {
  for (auto& [id, client] : clients_) {
    for (auto& [sequence, entry] : client.entries) {
      if (entry->done) budget_->ReleaseLocked(entry->remembered);
    }
  }
  clients_.clear();
}

}  // namespace losshead::server
