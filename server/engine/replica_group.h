// The devices of one head and the collective that joins them: a Replica per device (its part of W
// and dW, a stream, a workspace, I/O slots, the optimizer state of its rows, its deferred-dW stash)
// and what every placement does with them alike. How the rows are laid out over the devices, which
// devices a micro-batch takes and which collectives a cut runs is the placement's (placement.h):
// this group has no layout of its own, only each replica's `rows` (the rows it owns) and `held`
// (the rows of W and dW on its device).
//
// Everything that reads or writes the head as a whole (a pull, a push, an optimizer apply, a
// checkpoint) holds the Cut: every replica's compute lock, taken in rank order so that two cuts
// never deadlock. A micro-batch holds the compute locks of the devices it runs on, taken the same
// way (DeviceLocks).
#ifndef LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_
#define LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/process_group.h"
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
  // The asked token outputs, N x 4 bytes each, one after another (token_outputs.h).
  kernels::DeviceBuffer token_outputs;
  // The per-token inputs of the loss terms, N x 4 bytes each, one after another (token_inputs.h).
  kernels::DeviceBuffer token_inputs;
  kernels::DeviceBuffer scalars;  // kStepScalarBytes
  // hidden + targets in, then dH + per-token losses + token outputs out
  kernels::HostBuffer staging;
};

// A run's scalars, as they come back once its work is done: token count (int64, first: it needs
// 8-byte alignment), loss sum (fp32), correct count (int64, when asked).
inline constexpr size_t kStepScalarBytes = 24;
inline constexpr size_t kTokenCountOffset = 0;
inline constexpr size_t kLossSumOffset = 8;
inline constexpr size_t kCorrectCountOffset = 16;

// One device's part of a head. The tensors, the stream and the workspace are used under
// compute_mu only; the I/O slots under slots_mu.
struct Replica {
  Replica(kernels::Backend& backend, int rank, kernels::Shard rows, kernels::Shard held)
      : backend(backend), rank(rank), rows(rows), held(held) {}
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;
  ~Replica();

  kernels::Backend& backend;
  const int rank;
  // The rows this replica owns: its part of a reduced dW, and its rows of the optimizer's master
  // weights and state (ZeRO-1).
  const kernels::Shard rows;
  // The rows of W and dW this device holds (a superset of `rows`): every row for a replica, its
  // own for a shard. Row r of the head is row r - held.begin of the device's W and dW.
  const kernels::Shard held;

  // Micro-batches wait here, largest first, before they take compute_mu.
  ComputeQueue compute_queue;
  absl::Mutex compute_mu;
  // Runs launched under compute_mu whose work may still be on the device, not yet counted: a
  // micro-batch lets the next one launch behind its work before its own is done (the step
  // pipeline's RunOnDevices), and counts itself once it is. A Cut waits for none to be left.
  absl::Mutex flight_mu;
  int runs_in_flight ABSL_GUARDED_BY(flight_mu) = 0;
  // V x D in the head's dtype, the same on every replica; a shard's rows x D.
  kernels::DeviceBuffer weights;
  // V x D fp32: this replica's micro-batches since the last cut; a shard's rows x D, its rows of
  // every micro-batch since the last cut.
  kernels::DeviceBuffer grad;
  // A head with an output bias (HeadSpec.bias; empty otherwise): b over the held rows, fp32, a
  // copy of the head's (HeadBias: written under the cut only), and this replica's db
  // accumulator over the same rows, which its micro-batches add to in their run as they add to
  // dW (a shard: its rows of every micro-batch; a replica: the micro-batches it ran).
  kernels::DeviceBuffer bias;
  kernels::DeviceBuffer grad_bias;
  std::unique_ptr<kernels::Stream> stream;
  kernels::DeviceBuffer workspace ABSL_GUARDED_BY(compute_mu);
  OptimizerBuffers optimizer ABSL_GUARDED_BY(compute_mu);  // for `rows` only
  // A shard's statistics and dH partials of one token chunk (kernels::ShardArguments), and the
  // statistics of its distribution outputs (output_stats: grown only by a micro-batch that asks
  // for one).
  kernels::DeviceBuffer shard_stats ABSL_GUARDED_BY(compute_mu);
  kernels::DeviceBuffer shard_output_stats ABSL_GUARDED_BY(compute_mu);
  kernels::DeviceBuffer shard_partial ABSL_GUARDED_BY(compute_mu);

  // Deferred dW (kernels/grad_stash.h): counted micro-batches whose G and H wait here to be added
  // to `grad` (ReplicaGroup::FlushStash). stash_capacity is 0 until the first micro-batch sizes
  // the stash, and -1 where this device has none (not enabled, no such backend call, no memory
  // for it, or given back to memory that something else needed: ReleaseStash): micro-batches
  // then add to dW as they run.
  kernels::DeviceBuffer stash ABSL_GUARDED_BY(compute_mu);
  int64_t stash_capacity ABSL_GUARDED_BY(compute_mu) = 0;
  // -1 for want of memory only (the stash did not fit, or gave way): sized again at the next
  // micro-batch once a head has freed its memory on this device (stash_retry).
  bool stash_wanted ABSL_GUARDED_BY(compute_mu) = false;
  // Set without the lock when memory on this device was freed (Head::RetryStashes), taken by the
  // next micro-batch.
  std::atomic<bool> stash_retry{false};
  int64_t stash_tokens ABSL_GUARDED_BY(compute_mu) = 0;
  // Whether a micro-batch of `tokens` fits the stash only once the stash is flushed (one larger
  // than the whole stash bypasses it and adds to dW as it runs).
  bool StashFullFor(int64_t tokens) const {
    return stash_capacity > 0 && tokens <= stash_capacity && stash_tokens + tokens > stash_capacity;
  }
  // A flush that failed since the last cut: its tokens are counted but not in dW. The next cut
  // answers it (DATA_LOSS) and clears it.
  absl::Status stash_fault ABSL_GUARDED_BY(compute_mu);
  // stash_tokens, and when the last run ended (absl::GetCurrentTimeNanos), for the idle flush's
  // look without the lock.
  std::atomic<int64_t> stashed_tokens{0};
  std::atomic<int64_t> last_run_end_ns{0};
  // stash.bytes(), for a look without the lock (Head::StashBytes).
  std::atomic<size_t> stash_held{0};

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

// What each device holds of W and dW (the placement decides; the group only records it).
enum class Holding {
  kAllRows,  // every device all of W and dW (a replicated head, or one device)
  kOwnRows,  // device r only its rows ShardRange(V, k, r) (a vocabulary-sharded head)
};

class ReplicaGroup {
 public:
  // One replica per backend, rank r on devices[r], owning rows ShardRange(vocab_size, k, r) and
  // holding what `holding` says. INVALID_ARGUMENT for no device, a null one, or fewer rows than
  // devices. The collective is created only for k > 1 (INVALID_ARGUMENT or UNIMPLEMENTED from
  // CreateCollective for devices it cannot join).
  //
  // With `processes` (a head sharded across server processes; kOwnRows only): a collective call
  // of every process of that group. The devices of every process are the shards together, global
  // shard rank first_shard() + r on devices[r] owning and holding ShardRange(vocab_size,
  // shard_count(), first_shard() + r), process 0's devices first; the collective is
  // CreateProcessCollective's over them (whatever k here), so that the shard exchanges span
  // every process.
  static absl::StatusOr<std::unique_ptr<ReplicaGroup>> Create(
      std::span<kernels::Backend* const> devices, int64_t vocab_size, int64_t hidden_size,
      kernels::DType dtype, Holding holding = Holding::kAllRows,
      kernels::MatmulPrecision precision = kernels::MatmulPrecision::kHighest,
      std::shared_ptr<kernels::ProcessGroup> processes = nullptr);

  // Stops the idle flush, then waits for every replica's work before the collective and the
  // replicas' buffers go.
  ~ReplicaGroup();

  // Starts a thread that flushes a replica's stash once it has had no micro-batch queued or
  // running for `idle` (so that the dW GEMM runs while the trainers compute, not ahead of the
  // next answer). Once, before the first micro-batch; not at all for bit-identical dW whatever
  // the timing (the stash then empties when full and at cuts only).
  void StartIdleFlush(absl::Duration idle);

  // Under the replica's compute lock. Its stashed micro-batches added to its dW in one GEMM and
  // the stash emptied; waits for the GEMM. DATA_LOSS (and stash_fault set) when the device
  // fails: the stashed tokens are counted in the window but missing from dW.
  absl::Status FlushStash(Replica& replica);
  // Under each replica's compute lock. FlushStash for each, with every GEMM launched before any
  // is waited for: a sharded head's shards fill their stashes in step, and flushing them one
  // after another would leave k - 1 devices idle through each flush. The first failure, with
  // every failed replica's stash_fault set.
  absl::Status FlushStashes(std::span<Replica* const> replicas);

  // Under the replica's compute lock. Its stash flushed (FlushStash: a failure is kept as
  // stash_fault for the next cut) and freed: micro-batches on this replica add to dW as they run
  // until memory frees (stash_wanted). Returns the bytes freed (0 where it had none).
  size_t ReleaseStash(Replica& replica);

  int size() const { return static_cast<int>(replicas_.size()); }
  // The shards over every process (size() and 0 for a group of this process's devices alone):
  // replica r is shard first_shard() + r of shard_count().
  int shard_count() const { return shard_count_; }
  int first_shard() const { return first_shard_; }
  // The global rank of process `process`'s first shard (0 for a group of this process alone).
  int FirstShardOf(int process) const { return process_first_shards_[process]; }
  // This process's rank in the group it spans (0 for a group of this process alone).
  int process() const { return process_; }
  // Whether the group spans several processes (Create's `processes`).
  bool across_processes() const { return across_processes_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t hidden_size() const { return hidden_size_; }
  kernels::DType dtype() const { return dtype_; }
  // The head's GEMM precision (problem.h), for every kernels::Problem run on its devices.
  kernels::MatmulPrecision precision() const { return precision_; }
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
  Assignment Choose(int64_t tokens) { return Assignment(Next(), tokens); }
  // The replica Choose picks, for a caller that holds its Assignment in place.
  Replica& Next();

  // The compute locks of `devices` (ascending rank), taken in that order, for as long as it lives:
  // the same order as the Cut's, so that a micro-batch on several devices and a cut never
  // deadlock. `devices` must outlive it.
  class DeviceLocks {
   public:
    explicit DeviceLocks(std::span<Replica* const> devices);
    ~DeviceLocks();
    DeviceLocks(const DeviceLocks&) = delete;
    DeviceLocks& operator=(const DeviceLocks&) = delete;

   private:
    std::span<Replica* const> devices_;
  };

  // Every replica's compute lock, in rank order, for as long as it lives, taken once the runs in
  // flight on them are done and counted (Replica::runs_in_flight): W, dW and the window are then
  // what every micro-batch counted so far left.
  class Cut {
   public:
    explicit Cut(const ReplicaGroup& group);
    ~Cut();
    Cut(const Cut&) = delete;
    Cut& operator=(const Cut&) = delete;

   private:
    const ReplicaGroup& group_;
  };

  // Under the Cut. Every replica's stash flushed into its dW (FlushStashes), and a fault of an
  // earlier flush answered: DATA_LOSS when a flush fails now or failed since the last cut (each
  // replica's stash is flushed even so); the faults are cleared, this cut being the one that
  // answers them. Every cut that reads dW goes through here (through its placement).
  absl::Status FlushAllStashes();
  // Under the Cut, for replicas that each hold every row: FlushAllStashes, then dW reduced to the
  // owners of its rows (ReduceScatter): afterwards replica r's accumulator holds the sum over
  // replicas of its rows and zeros elsewhere. Enqueued on the replicas' streams; no reduction for
  // one replica.
  absl::Status ReduceGradientToOwners();
  // Under the Cut. The window dropped without being read: every replica's stash emptied without
  // adding it to dW (its micro-batches are in the window being dropped), a fault of an earlier
  // flush forgotten (the tokens it lost are dropped too), and every dW zeroed; waits for the
  // devices. A device failure leaves dW partly zeroed: the error is returned and the caller
  // keeps its counters (a later pull or discard cuts again).
  absl::Status DiscardGradient();
  // Under the Cut, for replicas that each hold every row: replica 0's W copied to every other
  // replica (Broadcast). Nothing to do for one replica.
  absl::Status BroadcastWeights();
  // Under the Cut, for replicas that each hold every row: each replica's own rows of W copied to
  // every other replica (AllGather). Nothing to do for one replica.
  absl::Status GatherWeights();
  // Under the locks of every shard, during a sharded run: each shard's statistics slice of a chunk
  // of up to `chunk_rows` tokens to every shard (AllGather), and with `output_stats_rows` > 0
  // (kernels::ShardOutputStatsRows) its slice of shard_output_stats beside it; the dH partials of
  // `floats` elements summed on global shard `root`, the one that returns dH (Reduce: the other
  // shards' partials are left unspecified). Nothing to do for one shard.
  absl::Status GatherShardStats(int64_t chunk_rows, int output_stats_rows);
  absl::Status SumShardPartials(int64_t floats, int root);
  // Under the locks of every shard, during a sharded run: `elements` of `dtype` copied from
  // global shard `root`'s buffer into every other shard's (Broadcast), `buffers` being this
  // process's shards' in rank order. Nothing to do for one shard.
  absl::Status BroadcastShards(std::span<void* const> buffers, int64_t elements,
                               kernels::DType dtype, int root);
  // Waits for every replica's stream; the first error.
  absl::Status Synchronize();

  // Offsets of a replica's rows in elements of a V x D tensor.
  int64_t RowOffset(const Replica& replica) const { return replica.rows.begin * hidden_size_; }
  int64_t RowElements(const Replica& replica) const { return replica.rows.size() * hidden_size_; }
  // Where those rows start in the replica's own W and dW.
  int64_t DeviceRowOffset(const Replica& replica) const {
    return (replica.rows.begin - replica.held.begin) * hidden_size_;
  }
  // Rows of W and dW a device holds.
  static int64_t DeviceRows(const Replica& replica) { return replica.held.size(); }

 private:
  ReplicaGroup(int64_t vocab_size, int64_t hidden_size, kernels::DType dtype,
               kernels::MatmulPrecision precision)
      : vocab_size_(vocab_size), hidden_size_(hidden_size), dtype_(dtype), precision_(precision) {}
  std::vector<void*> Buffers(kernels::DeviceBuffer Replica::*tensor) const;
  std::vector<kernels::Stream*> Streams() const;

  const int64_t vocab_size_;
  const int64_t hidden_size_;
  const kernels::DType dtype_;
  const kernels::MatmulPrecision precision_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<kernels::Collective> collective_;  // null for one replica of one process
  int shard_count_ = 0;
  int first_shard_ = 0;
  std::vector<int> process_first_shards_{0};
  int process_ = 0;
  bool across_processes_ = false;
  std::atomic<uint64_t> next_tie_{0};
  absl::Notification stop_idle_flush_;
  std::thread idle_flush_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_REPLICA_GROUP_H_
