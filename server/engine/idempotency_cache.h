// Remembers completed micro-batches of one head by (client id, sequence) so that a retry replays
// the original loss and dH instead of adding to dW a second time.
//
// Window: per client id, the `window` completed results with the highest sequence numbers are
// kept, and fewer while their bytes (dH + per-token losses) exceed `max_bytes_per_client` (the
// newest one is always kept). Results leave the window lowest sequence first. Server-wide, the
// results of every head count against one IdempotencyBudget (idempotency_budget.h): the oldest
// leave when they are older than its ttl or while all of them hold more than its bytes.
//
// Whatever evicted it, a request whose sequence is <= the highest evicted one of its client id
// and that is not remembered is FAILED_PRECONDITION naming the evictions that reached that far
// ("outside the replay window", the client's or the server's byte cap, the age): it may have been
// counted already, and the server cannot tell, so it is never computed again. This floor is kept
// per client id for the head's lifetime (a few dozen bytes each, in checkpoints too); deleting the
// head forgets them all.
// A repeat of a sequence still being computed waits for the original and replays its result.
// Micro-batches that failed before their run (validation, version, staging) are not remembered: a
// retry of one computes afresh.
//
// A key answers only what it was first used for: every claim carries the micro-batch's
// fingerprint (request_fingerprint.h), and a repeat whose fingerprint differs (other hidden states,
// targets, num_tokens, dtypes, options or loss options) is ALREADY_EXISTS, naming the client id,
// the sequence and what differs; it counts nothing and leaves the remembered outcome as it was.
//
// A micro-batch that may be in dW without a result to replay (the device failed after its run
// began) is remembered with that failure (Fail): every repeat of its key gets the same error and
// none is computed again, so no retry can add it to dW twice.
//
// Thread-safe: the state is guarded by the budget's mutex, shared by the caches of a server.
#ifndef LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_
#define LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/head_checkpoint.h"
#include "server/engine/idempotency_budget.h"
#include "server/engine/request_fingerprint.h"
#include "server/engine/step_outcome.h"

namespace losshead::server {

class IdempotencyCache {
 public:
  // `budget`: the server-wide bound its results count against, shared by the heads of a server;
  // null: a budget of its own, without a server-wide bound or an age limit.
  IdempotencyCache(size_t window, size_t max_bytes_per_client,
                   std::shared_ptr<IdempotencyBudget> budget = nullptr);
  // Its results leave the budget (they are forgotten, not counted as evicted).
  ~IdempotencyCache();
  IdempotencyCache(const IdempotencyCache&) = delete;
  IdempotencyCache& operator=(const IdempotencyCache&) = delete;

  // Either a remembered outcome to replay (its `failure` may be set: answer with it), or (null) a
  // claim: the caller must compute the micro-batch and then call exactly one of Complete, Fail or
  // Abandon with the same key. Blocks while another caller holds the claim on the same key (with
  // the same fingerprint). FAILED_PRECONDITION for a sequence evicted (at or below the client's
  // floor, not remembered), naming the evictions; ALREADY_EXISTS when the key was used for a
  // micro-batch with another fingerprint (remembered or still computing). Results past the
  // budget's ttl are evicted first.
  absl::StatusOr<std::shared_ptr<const StepOutcome>> Begin(const std::string& client_id,
                                                           uint64_t sequence,
                                                           const StepFingerprint& fingerprint);
  // Remembers `outcome` for the claim, stamped with the claim's fingerprint.
  void Complete(const std::string& client_id, uint64_t sequence,
                std::shared_ptr<StepOutcome> outcome);
  // The micro-batch may be in dW but has no result: remember `failure` (not OK) as the answer of
  // every repeat. It counts as applied (max_applied) and takes a place in the window.
  void Fail(const std::string& client_id, uint64_t sequence, absl::Status failure);
  // The computation failed before it could touch dW: forget the claim; waiters (retries) compute
  // on their own. No-op once the claim is completed or failed.
  void Abandon(const std::string& client_id, uint64_t sequence);

  // Completed results remembered for `client_id` (tests and stats).
  size_t remembered(const std::string& client_id) const;

  // The highest sequence completed for `client_id`, remembered or evicted; nullopt if none.
  std::optional<uint64_t> max_applied(const std::string& client_id) const;
  // Completed state of every client id, for a checkpoint; claims still computing are left out
  // (the caller makes sure none of them has touched dW yet: see Head::Snapshot). Results past the
  // budget's ttl are evicted first: a checkpoint holds what is remembered, no more.
  std::vector<ClientCheckpoint> Export();
  // Replaces all state with `clients` (a restored checkpoint), before the head serves. The window,
  // the byte cap and the budget apply to what it brings.
  void Import(const std::vector<ClientCheckpoint>& clients);

 private:
  friend class IdempotencyBudget;
  using Cause = IdempotencyBudget::Cause;

  struct Entry {
    bool done = false;
    bool abandoned = false;
    // From the claim; restored outcomes bring theirs (none from a format <= 2 checkpoint).
    std::optional<StepFingerprint> fingerprint;
    std::shared_ptr<const StepOutcome> outcome;
    IdempotencyBudget::Order::iterator remembered;  // once done: its place in the budget
  };
  struct EvictedRange {
    uint64_t lowest = 0;
    uint64_t highest = 0;
  };
  struct Client {
    std::map<uint64_t, std::shared_ptr<Entry>> entries;  // by sequence: eviction takes the lowest
    size_t done_count = 0;
    size_t done_bytes = 0;
    std::optional<uint64_t> max_evicted;
    // The sequences each cause evicted lie within its range; a floor restored from a checkpoint
    // has no cause: it covers every sequence up to it.
    std::array<std::optional<EvictedRange>, IdempotencyBudget::kCauses> evicted_by;
    std::optional<uint64_t> restored_floor;
    std::optional<uint64_t> max_applied;
  };

  absl::Mutex& mu() const ABSL_LOCK_RETURNED(budget_->mu_) { return budget_->mu_; }
  // Remembers `outcome` for the claim on (client_id, sequence), if it is still a claim.
  void SettleLocked(const std::string& client_id, uint64_t sequence,
                    std::shared_ptr<StepOutcome> outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu());
  // Evicts `client`'s lowest results while it holds more than the window or the byte cap.
  void TrimLocked(Client& client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu());
  // Lets the completed result at `it` go for `cause`, raising the client's floor.
  void EvictEntryLocked(Client& client, std::map<uint64_t, std::shared_ptr<Entry>>::iterator it,
                        Cause cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu());
  // For the budget: evicts the completed result of (client_id, sequence); false if there is none.
  bool EvictLocked(const std::string& client_id, uint64_t sequence, Cause cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu());
  // Forgets every client id, releasing their results from the budget.
  void ClearLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu());
  // The FAILED_PRECONDITION of a repeat of `sequence` at or below the client's floor.
  absl::Status EvictedError(const std::string& client_id, uint64_t sequence,
                            const Client& client) const;

  const size_t window_;
  const size_t max_bytes_per_client_;
  const std::shared_ptr<IdempotencyBudget> budget_;
  absl::flat_hash_map<std::string, Client> clients_ ABSL_GUARDED_BY(mu());
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_
