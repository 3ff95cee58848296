// A micro-batch as it reaches a head (MicroBatch: as it came off the wire) and what a head reports
// of its way through the step pipeline besides its outcome (StepStats, for metrics).
#ifndef LOSSHEAD_SERVER_ENGINE_MICRO_BATCH_H_
#define LOSSHEAD_SERVER_ENGINE_MICRO_BATCH_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/pinned_pool.h"
#include "server/engine/token_inputs.h"

namespace losshead::server {

// One micro-batch as it came off the wire.
struct MicroBatch {
  v1::StepHeader header;
  std::string hidden;
  // Set instead of `hidden` when the receiver assembled the hidden states in page-locked memory
  // (see PinnedPool): they then go to the device without another host copy. Shared by copies of
  // the micro-batch (nothing writes to it once assembled).
  std::shared_ptr<PinnedBytes> pinned_hidden;
  std::string targets;
  // The per-token inputs' bytes (token_inputs.h), by TokenInput, as received: empty where none
  // came. Small (4 bytes per token each), so they are digested and checked when prepared.
  std::array<std::string, kTokenInputs> token_inputs;
  // ByteDigest values of hidden and targets when the receiver took them while assembling (see
  // StepAssembler); Head::Step computes a missing one when the micro-batch needs a fingerprint.
  std::optional<uint64_t> hidden_digest;
  std::optional<uint64_t> targets_digest;
  // The largest |x| of hidden in its header's dtype (kernels::MaxAbs: +Inf when it holds a NaN or
  // Inf), when the receiver took it as the pieces arrived; Head::Step takes it itself when unset.
  std::optional<float> hidden_max_abs;
  // Set on the processes other than its origin for a micro-batch of a head sharded across
  // processes (Head::RunStep): `hidden` is empty, and the hidden states reach this process's
  // shards in the run, broadcast from the origin's first shard; hidden_max_abs is the origin's.
  bool hidden_elsewhere = false;
  // Where dH goes as well, device to device (a same-node client's device region, mapped into
  // this process; null: nowhere): `grad_hidden_to_bytes` of room. Copied by the device that
  // computes it, as the run's last work there, before Head::Step returns; StepStats::
  // grad_hidden_delivery says whether it was. Not part of the fingerprint, nor of what a replay
  // answers with: a replay's dH goes there the caller's way, from the host.
  void* grad_hidden_to = nullptr;
  size_t grad_hidden_to_bytes = 0;

  absl::string_view hidden_bytes() const {
    return pinned_hidden != nullptr ? pinned_hidden->view() : absl::string_view(hidden);
  }
  // Frees the tensors (the micro-batch is answered, or refused before it ran).
  void ReleaseTensors() {
    std::string().swap(hidden);
    pinned_hidden.reset();
    std::string().swap(targets);
    for (std::string& input : token_inputs) std::string().swap(input);
  }
};

// What happened to a micro-batch besides its outcome (for metrics).
struct StepStats {
  bool replayed = false;
  absl::Duration queue;    // waiting for the head (an I/O slot, then the compute mutex)
  absl::Duration stage;    // copies in (host -> device), before the compute mutex
  absl::Duration compute;  // Run under the compute mutex, synchronised
  absl::Duration finish;   // copies out (dH -> host), after the compute mutex
  // Set when dH was copied to MicroBatch::grad_hidden_to: OK, or why that copy failed (dH is
  // then in the outcome only). Unset where it was not tried: no destination, a replay, dH in a
  // dtype other than the computed one, or too little room.
  std::optional<absl::Status> grad_hidden_delivery;
  // The devices the run took: its replica, or every shard of a sharded head (empty if it never
  // reached one).
  std::vector<const kernels::Backend*> devices;
  // When each phase began or ended (for --step_trace); UnixEpoch when it was not reached.
  absl::Time stage_start = absl::UnixEpoch();
  absl::Time compute_start = absl::UnixEpoch();
  absl::Time compute_end = absl::UnixEpoch();
  absl::Time finish_end = absl::UnixEpoch();
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_MICRO_BATCH_H_
