// The vocabulary-sharded placement: device r holds only its rows ShardRange(V, k, r) of W and dW
// (and of the optimizer), and every micro-batch runs on all of them together, under every shard's
// compute lock (the cut). Each shard computes its rows' logits of each token chunk, the shards
// exchange their softmax statistics (AllGather; and beside them those of the distribution outputs
// and top-k, when asked), each writes its columns of the gradient and its part of dH and dW (or of
// its stash: deferred dW), and the dH parts are summed (Reduce) and rounded on shard 0, which
// returns the results and the outputs. The sequence and its math are the backend's (see
// losshead/kernels/shard_problem.h); this placement drives it over the shards' streams.
//
// Across server processes (ReplicaGroup::across_processes: Placement.across_processes), the
// shards are those of every process, their exchanges the process collective's, and this process
// drives its own: every process runs every micro-batch, in the same order (the group's leader
// orders them), and computes the same chunks (each plans every process's shards). The row math
// is the same code: a shard's part and rank are its global ones.
//
// dW needs no reduction at a cut (each shard holds the whole window of its rows) and W no copies
// (no row is held twice): the cut's collectives are no-ops beyond flushing the stashes.
#ifndef LOSSHEAD_SERVER_ENGINE_SHARDED_PLACEMENT_H_
#define LOSSHEAD_SERVER_ENGINE_SHARDED_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"
#include "server/engine/placement.h"

namespace losshead::server {

class ShardedPlacement final : public Placement {
 public:
  // `group` holds each device's own rows (Holding::kOwnRows).
  explicit ShardedPlacement(std::unique_ptr<ReplicaGroup> group);

  // Every shard, in rank order.
  std::span<Replica* const> WeightHolders() const override { return shards_; }
  absl::Status CheckWorkspace(Replica& replica, size_t budget) const override;
  // Every shard, in rank order (so that its locks are the cut's).
  void Take(int64_t tokens, StepDevices& devices) override;
  absl::Status Prepare(const StepRun& run, StepDevices& devices, DeviceScratch& scratch) override;
  absl::Status Run(const StepRun& run, StepDevices& devices) override;
  // The first shard: the hidden states cross the host once and reach the other shards over the
  // collective (NVLink between GPUs) instead of once per shard.
  int HiddenRoot() const override { return shards_.size() > 1 ? group().first_shard() : -1; }
  absl::Status ReduceGradientToOwners() override { return group().FlushAllStashes(); }
  absl::Status BroadcastWeights() override { return absl::OkStatus(); }
  absl::Status GatherWeights() override { return absl::OkStatus(); }

 private:
  // Run's chunks, once every shard has begun.
  absl::Status RunChunks(const StepRun& run, StepDevices& devices);
  kernels::ShardProblem ShardOf(const kernels::Problem& problem, const Replica& shard) const;

  std::vector<Replica*> shards_;
  // The plan of the micro-batch between its Prepare and its Run: each shard's part and workspace
  // bytes, and the token chunk they share. Only a micro-batch holding every shard's lock touches
  // it, so one serves every micro-batch (and keeps its vectors' memory from one to the next).
  std::vector<kernels::ShardProblem> parts_;
  std::vector<size_t> workspace_bytes_;
  std::vector<kernels::ShardArguments> args_;
  int64_t chunk_rows_ = 0;
  // Rows of output_stats per shard (kernels::ShardOutputStatsRows), 0 when no distribution output
  // is asked for.
  int output_stats_rows_ = 0;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_SHARDED_PLACEMENT_H_
