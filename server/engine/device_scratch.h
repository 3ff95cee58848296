// What a head's micro-batches borrow of its devices' memory beyond W and dW: the buffers of a run
// (workspace, I/O slot buffers, a shard's exchange buffers, staging host memory) and the
// deferred-dW stashes (docs/deferred-dw.md). A buffer that only speeds micro-batches up never
// stands in the way of memory that something needs: when a device is full, a replica's own stash
// gives way first, then the other heads' idle stashes there (the take-back hook: the registry's
// StashLenders). Used by the step
// pipeline and the placements' runs; the head's public stash calls (Head::ReleaseStashes and the
// like) are answered here.
#ifndef LOSSHEAD_SERVER_ENGINE_DEVICE_SCRATCH_H_
#define LOSSHEAD_SERVER_ENGINE_DEVICE_SCRATCH_H_

#include <cstddef>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "server/engine/replica_group.h"

namespace losshead::server {

class DeviceScratch {
 public:
  // Gives back other heads' idle stashes on a device until `bytes` would fit there; returns the
  // bytes given back (0: that would not make room, nothing was given back).
  using TakeBack = std::function<size_t(kernels::Backend& device, size_t bytes)>;

  // For the replicas of `group`, which outlives it. `take_back` may be null (no other heads lend
  // their stashes); `stash_bytes` 0: no stash.
  DeviceScratch(std::string head_name, TakeBack take_back, size_t stash_bytes, ReplicaGroup& group)
      : head_name_(std::move(head_name)),
        take_back_(std::move(take_back)),
        stash_bytes_(stash_bytes),
        group_(group) {}

  // Grows `buffer` on `replica` (which the caller owns exclusively: under its compute lock, as
  // `compute_locked` says, or in its I/O slot) to at least `bytes`. When the device is full and the
  // replica's stash holds enough to make room, the stash gives way (ReleaseStash) and the
  // allocation is tried once more; then, where the other heads' idle stashes on the device would
  // make room, those. RESOURCE_EXHAUSTED when it still does not fit.
  absl::Status Ensure(Replica& replica, kernels::DeviceBuffer& buffer, size_t bytes,
                      bool compute_locked);
  // Grows a slot's staging host buffer; false where the backend needs none (copy directly).
  absl::StatusOr<bool> EnsureStaging(Replica& replica, kernels::HostBuffer& buffer, size_t bytes);

  // Under the replica's compute lock: where a counted micro-batch of `problem` (a shard's: its
  // ShardStashShape) leaves its part of dW. The stash's next rows (flushed first when they would
  // not fit; the stash made on first use), or no stash (the run adds to dW itself) when deferral is
  // off for this head or device, or the micro-batch is larger than the stash.
  absl::StatusOr<kernels::GradStash> StashFor(Replica& replica, const kernels::Problem& problem);

  // Head::StashBytes, ReleaseStashes, RetryStashes and TryReleaseStashes (see head.h).
  size_t StashBytes(const kernels::Backend* device) const;
  size_t ReleaseStashes(const kernels::Backend* device);
  void RetryStashes(const kernels::Backend* device);
  size_t TryReleaseStashes(const kernels::Backend* device);

 private:
  void ReportReleased(size_t bytes) const;

  const std::string head_name_;
  const TakeBack take_back_;
  const size_t stash_bytes_;
  ReplicaGroup& group_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_DEVICE_SCRATCH_H_
