// Remembers a head's recent optimizer applies by (client id, step key), so that a retried apply
// answers the first one's response instead of stepping twice.
//
// Keys of one client id must increase. Per client id the `window` most recent responses are
// kept; a key that is not remembered and is at or below the client id's highest applied key is
// refused (FAILED_PRECONDITION): it may have stepped already and its answer is gone, or it came
// out of order. A key answers only what it was first used for: a repeat whose request differs in
// its hyper-parameters, divisor, clipping fields or expected version (ApplyFingerprint) is
// ALREADY_EXISTS, naming the client id, the key and what differs, and steps nothing. Not
// thread-safe: the head uses it under its compute lock, in the same critical section as the step
// it records, so a retry racing its original waits for it and replays it.
#ifndef LOSSHEAD_SERVER_ENGINE_APPLY_LOG_H_
#define LOSSHEAD_SERVER_ENGINE_APPLY_LOG_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/head_checkpoint.h"

namespace losshead::server {

class ApplyLog {
 public:
  explicit ApplyLog(size_t window) : window_(window < 1 ? 1 : window) {}

  // The remembered response of (client_id, key) with replayed = true; nullopt for a key that
  // may be applied now; FAILED_PRECONDITION for one at or below the highest applied key;
  // ALREADY_EXISTS for a remembered key whose `fingerprint` (ApplyFingerprint) differs.
  absl::StatusOr<std::optional<v1::ApplyOptimizerResponse>> Find(
      const std::string& client_id, uint64_t key, const std::string& fingerprint) const;
  // Records a successful apply (the key Find allowed) with what it asked for.
  void Record(const std::string& client_id, uint64_t key, std::string fingerprint,
              const v1::ApplyOptimizerResponse& response);

  // For checkpoints, by client id; Import replaces everything.
  std::vector<ApplyClientCheckpoint> Export() const;
  void Import(const std::vector<ApplyClientCheckpoint>& clients);

 private:
  struct Remembered {
    std::string fingerprint;  // empty: restored from a format <= 2 checkpoint, unchecked
    v1::ApplyOptimizerResponse response;
  };
  struct Client {
    uint64_t max_applied = 0;
    std::map<uint64_t, Remembered> responses;  // by key: eviction takes the lowest
  };
  const size_t window_;
  absl::flat_hash_map<std::string, Client> clients_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_APPLY_LOG_H_
