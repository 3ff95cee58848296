// Remembers completed micro-batches of one head by (client id, sequence) so that a retry replays
// the original loss and dH instead of adding to dW a second time.
//
// Window: per client id, the `window` completed results with the highest sequence numbers are
// kept, and fewer while their bytes (dH + per-token losses) exceed `max_bytes_per_client` (the
// newest one is always kept). Results leave the window lowest sequence first; a request whose
// sequence is <= the highest evicted one and that is not remembered is FAILED_PRECONDITION
// ("outside the replay window"): it may have been counted already, and the server cannot tell.
// A repeat of a sequence still being computed waits for the original and replays its result.
// Micro-batches that failed before their run (validation, version, staging) are not remembered: a
// retry of one computes afresh. Client ids are tracked for the head's lifetime; deleting the head
// forgets them all.
//
// A key answers only what it was first used for: every claim carries the micro-batch's
// fingerprint (request_fingerprint.h), and a repeat whose fingerprint differs (other hidden states,
// targets, num_tokens, dtypes, options or loss options) is ALREADY_EXISTS, naming the client id,
// the sequence and what differs; it counts nothing and leaves the remembered outcome as it was.
//
// A micro-batch that may be in dW without a result to replay (the device failed after its run
// began) is remembered with that failure (Fail): every repeat of its key gets the same error and
// none is computed again, so no retry can add it to dW twice.
#ifndef LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_
#define LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_

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
#include "server/engine/request_fingerprint.h"
#include "server/engine/step_outcome.h"

namespace losshead::server {

class IdempotencyCache {
 public:
  IdempotencyCache(size_t window, size_t max_bytes_per_client)
      : window_(window), max_bytes_per_client_(max_bytes_per_client) {}

  // Either a remembered outcome to replay (its `failure` may be set: answer with it), or (null) a
  // claim: the caller must compute the micro-batch and then call exactly one of Complete, Fail or
  // Abandon with the same key. Blocks while another caller holds the claim on the same key (with
  // the same fingerprint). FAILED_PRECONDITION outside the window; ALREADY_EXISTS when the key was
  // used for a micro-batch with another fingerprint (remembered or still computing).
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
  // (the caller makes sure none of them has touched dW yet: see Head::Snapshot).
  std::vector<ClientCheckpoint> Export() const;
  // Replaces all state with `clients` (a restored checkpoint), before the head serves.
  void Import(const std::vector<ClientCheckpoint>& clients);

 private:
  struct Entry {
    bool done = false;
    bool abandoned = false;
    // From the claim; restored outcomes bring theirs (none from a format <= 2 checkpoint).
    std::optional<StepFingerprint> fingerprint;
    std::shared_ptr<const StepOutcome> outcome;
  };
  struct Client {
    std::map<uint64_t, std::shared_ptr<Entry>> entries;  // by sequence: eviction takes the lowest
    size_t done_count = 0;
    size_t done_bytes = 0;
    std::optional<uint64_t> max_evicted;
    std::optional<uint64_t> max_applied;
  };

  // Remembers `outcome` for the claim on (client_id, sequence), if it is still a claim.
  void SettleLocked(const std::string& client_id, uint64_t sequence,
                    std::shared_ptr<StepOutcome> outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictLocked(Client& client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t window_;
  const size_t max_bytes_per_client_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_IDEMPOTENCY_CACHE_H_
