// What a head's checkpoint holds, as data: the consistent cut that Head::Snapshot takes and
// Head::Restore reads back (server/engine/head_checkpoint.cc). The file format that carries it is
// durability's (server/durability/checkpoint.h); the engine knows no files.
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_CHECKPOINT_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/step_outcome.h"

namespace losshead::server {

// The idempotency state of one client id (see IdempotencyCache).
struct ClientCheckpoint {
  std::string client_id;
  std::optional<uint64_t> max_evicted;
  std::optional<uint64_t> max_applied;
  // Completed results by increasing sequence, each with its fingerprint and, for a micro-batch
  // that may be in dW without a result, its remembered failure (see StepOutcome).
  std::vector<std::pair<uint64_t, std::shared_ptr<const StepOutcome>>> results;
};

// One remembered optimizer apply (see ApplyLog): its key, what it asked for (ApplyFingerprint;
// empty when restored from a checkpoint older than fingerprints, format <= 2: a repeat of it
// replays unchecked) and its response.
struct RememberedApply {
  uint64_t key = 0;
  std::string fingerprint;
  v1::ApplyOptimizerResponse response;
};

// The remembered optimizer applies of one client id (see ApplyLog).
struct ApplyClientCheckpoint {
  std::string client_id;
  uint64_t max_applied = 0;
  std::vector<RememberedApply> responses;  // by increasing key
};

// Which rows a checkpoint set's part of a head sharded across processes holds
// (Placement.across_processes; docs/multi-process.md): the rows of this process's shards, global
// shard ranks [first_shard, first_shard + devices) of `shards`, in a group of `processes` where
// this process is `process`. Its tensors (W, dW, the optimizer's) then hold rows
// [first_row, first_row + row_count) only; the rest of the part (spec, versions, counters,
// applies, this process's clients) is as in a whole head's.
struct CheckpointRows {
  uint32_t processes = 0;
  uint32_t process = 0;
  uint32_t shards = 0;
  uint32_t first_shard = 0;
  uint32_t devices = 0;
  uint64_t first_row = 0;
  uint64_t row_count = 0;
};

struct HeadCheckpointData {
  v1::HeadSpec spec;  // default_options: the head's current defaults
  uint64_t weights_version = 1;
  uint64_t tokens_since_pull = 0;
  uint64_t microbatches_since_pull = 0;
  uint64_t min_version_since_pull = 0;
  uint64_t max_version_since_pull = 0;
  uint64_t tokens_total = 0;
  uint64_t microbatches_total = 0;
  std::string weights;                    // V x D in spec.weight_dtype (rows: its rows x D)
  std::string gradient;                   // V x D fp32 (rows: its rows x D)
  std::vector<ClientCheckpoint> clients;  // by client id
  // The optimizer (spec.optimizer says which; none: the fields below stay empty): its step count,
  // SGD's momentum bit, the weights version its master copy was taken at, the master copy (fp32,
  // BF16 and FP16 heads only) and the state buffers (StateBufferCount's order, fp32), and the
  // remembered applies.
  uint64_t optimizer_step = 0;
  bool momentum_started = false;
  uint64_t master_version = 0;
  std::string master;
  std::vector<std::string> optimizer_state;
  std::vector<ApplyClientCheckpoint> applies;  // by client id
  // A head with an output bias (spec.bias; empty otherwise, as in checkpoints older than format
  // 6): b, the window's db, and b's optimizer state (StateBufferCount's order), V fp32 each.
  std::string bias;
  std::string grad_bias;
  std::vector<std::string> bias_optimizer_state;
  // Only some rows (a part of a head sharded across processes, format 7); none: every row, and
  // the tensors above are V x D.
  std::optional<CheckpointRows> rows;
};

// OK when `rows` are the rows a process `process` of `processes` holding `devices` shards of a
// head of `spec` wrote: FAILED_PRECONDITION for another group size, rank or device count (the
// part belongs to another layout), DATA_LOSS when its rows are not those its shards own.
absl::Status CheckPartRows(const CheckpointRows& rows, const v1::HeadSpec& spec, int processes,
                           int process, int devices);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_CHECKPOINT_H_
