// The devices of one head: a replica per device, each with all of W, a dW accumulator of its own,
// a stream, a workspace, I/O slots and the optimizer state of its rows, and the collective that
// joins them. A one-device head is a group of one (no collective; every call below is then a
// no-op or the obvious single-device step).
//
// Micro-batches run whole on one replica (Choose); everything that reads or writes the head as a
// whole (a pull, a push, an optimizer apply, a checkpoint) holds the Cut: every replica's compute
// lock, taken in rank order so that two cuts never deadlock. Under it the dW accumulators are
// reduced to their owners (ReduceGradientToOwners): replica r then holds the window's sum of its
// rows ShardRange(V, k, r) and zeros elsewhere, the same window in a layout from which each
// replica copies or steps its own rows.
#ifndef LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_
#define LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/problem.h"
#include "server/engine/compute_queue.h"
#include "server/engine/head_optimizer.h"

namespace losshead::server {

// One micro-batch's device buffers, its staging host memory (empty where the backend needs none)
// and a stream of its own for the copies, so that they run beside another micro-batch's Run.
struct IoSlot {
  std::unique_ptr<kernels::Stream> copies;
  kernels::DeviceBuffer hidden;
  kernels::DeviceBuffer targets;
  kernels::DeviceBuffer grad_hidden;
  kernels::DeviceBuffer per_token;
  kernels::DeviceBuffer scalars;
  kernels::HostBuffer staging;  // hidden + targets in, then dH + per-token losses out
};

// One device's part of a head. The tensors, the stream and the workspace are used under
// compute_mu only; the I/O slots under slots_mu.
struct Replica {
  Replica(kernels::Backend& backend, int rank, kernels::Shard rows)
      : backend(backend), rank(rank), rows(rows) {}
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;
  ~Replica();

  kernels::Backend& backend;
  const int rank;
  // The rows this replica owns: its part of a reduced dW, and its rows of the optimizer's master
  // weights and state (ZeRO-1).
  const kernels::Shard rows;

  // Micro-batches wait here, largest first, before they take compute_mu.
  ComputeQueue compute_queue;
  absl::Mutex compute_mu;
  kernels::DeviceBuffer weights;  // V x D in the head's dtype, the same on every replica
  kernels::DeviceBuffer grad;     // V x D fp32: this replica's micro-batches since the last cut
  std::unique_ptr<kernels::Stream> stream;
  kernels::DeviceBuffer workspace ABSL_GUARDED_BY(compute_mu);
  OptimizerBuffers optimizer ABSL_GUARDED_BY(compute_mu);  // for `rows` only

  // I/O slots: a micro-batch takes one for its copies in, its run and its copies out. Three let
  // one run while the next is copied in and the previous is copied out.
  static constexpr size_t kIoSlots = 3;
  absl::Mutex slots_mu;
  std::vector<std::unique_ptr<IoSlot>> free_slots ABSL_GUARDED_BY(slots_mu);

  // Tokens of the micro-batches sent here and not yet through their run (Choose's measure).
  std::atomic<int64_t> queued_tokens{0};
  // Workspace and I/O buffers on this device (HeadInfo's workspace bytes).
  std::atomic<size_t> scratch_bytes{0};
};

class ReplicaGroup {
 public:
  // One replica per backend, rank r on devices[r], owning rows ShardRange(vocab_size, k, r).
  // The collective is created only for k > 1 (INVALID_ARGUMENT or UNIMPLEMENTED from
  // CreateCollective for devices it cannot join).
  static absl::StatusOr<std::unique_ptr<ReplicaGroup>> Create(
      std::span<kernels::Backend* const> devices, int64_t vocab_size, int64_t hidden_size,
      kernels::DType dtype);

  // Waits for every replica's work before the collective and the replicas' buffers go.
  ~ReplicaGroup();

  int size() const { return static_cast<int>(replicas_.size()); }
  Replica& operator[](int rank) const { return *replicas_[rank]; }
  std::span<const std::unique_ptr<Replica>> replicas() const { return replicas_; }

  // A micro-batch's replica; its tokens count as queued there until Release (or destruction).
  class Assignment {
   public:
    Assignment(Replica& replica, int64_t tokens) : replica_(replica), tokens_(tokens) {
      replica_.queued_tokens += tokens_;
    }
    ~Assignment() { Release(); }
    Assignment(const Assignment&) = delete;
    Assignment& operator=(const Assignment&) = delete;
    Replica& replica() const { return replica_; }
    void Release() {
      replica_.queued_tokens -= tokens_;
      tokens_ = 0;
    }

   private:
    Replica& replica_;
    int64_t tokens_;
  };

  // The replica a micro-batch of `tokens` runs on: the one with the fewest tokens queued, ties
  // going round the ranks in turn (so that micro-batches sent one at a time alternate, the same
  // way on every run).
  Assignment Choose(int64_t tokens);

  // Every replica's compute lock, in rank order, for as long as it lives.
  class Cut {
   public:
    explicit Cut(const ReplicaGroup& group);
    ~Cut();
    Cut(const Cut&) = delete;
    Cut& operator=(const Cut&) = delete;

   private:
    const ReplicaGroup& group_;
  };

  // Under the Cut. dW reduced to its owners (see the file comment): afterwards replica r's
  // accumulator holds the sum over replicas of its rows and zeros elsewhere. Enqueued on the
  // replicas' streams; nothing to do for one replica.
  absl::Status ReduceGradientToOwners();
  // Under the Cut. Replica 0's W copied to every other replica (after a push or a restore).
  absl::Status BroadcastWeights();
  // Under the Cut. Each replica's own rows of W copied to every other replica (after each stepped
  // its rows).
  absl::Status GatherWeights();
  // Waits for every replica's stream; the first error.
  absl::Status Synchronize();

  // Offsets of a replica's rows in elements of a V x D tensor.
  int64_t RowOffset(const Replica& replica) const { return replica.rows.begin * hidden_size_; }
  int64_t RowElements(const Replica& replica) const { return replica.rows.size() * hidden_size_; }

 private:
  ReplicaGroup(int64_t vocab_size, int64_t hidden_size, kernels::DType dtype)
      : vocab_size_(vocab_size), hidden_size_(hidden_size), dtype_(dtype) {}
  std::vector<void*> Buffers(kernels::DeviceBuffer Replica::*tensor) const;
  std::vector<kernels::Stream*> Streams() const;

  const int64_t vocab_size_;
  const int64_t hidden_size_;
  const kernels::DType dtype_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<kernels::Collective> collective_;  // null for one replica
  std::atomic<uint64_t> next_tie_{0};
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_
