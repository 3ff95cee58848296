// Placements where every device holds all of W: a micro-batch runs whole on one device, the one
// with the fewest tokens queued (ReplicaGroup::Next), under that device's compute lock alone, and
// adds to that device's dW accumulator. A cut reduces the accumulators to the owners of their rows
// (ZeRO-1: each device holds the optimizer state of its rows) and copies W from the holder
// (replica 0) or from each row's owner to every device, over the collective.
#ifndef LOSSHEAD_SERVER_ENGINE_REPLICATED_PLACEMENT_H_
#define LOSSHEAD_SERVER_ENGINE_REPLICATED_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "server/engine/placement.h"

namespace losshead::server {

class ReplicatedPlacement : public Placement {
 public:
  // `group` holds every row on each device (Holding::kAllRows).
  explicit ReplicatedPlacement(std::unique_ptr<ReplicaGroup> group)
      : Placement(std::move(group)), holder_(&this->group()[0]) {}

  // Replica 0: every replica holds the same W.
  std::span<Replica* const> WeightHolders() const override { return {&holder_, 1}; }
  absl::Status CheckWorkspace(Replica& replica, size_t budget) const override;
  void Take(int64_t tokens, StepDevices& devices) override;
  absl::Status Prepare(const StepRun& run, StepDevices& devices, DeviceScratch& scratch) override;
  absl::Status Run(const StepRun& run, StepDevices& devices) override;
  absl::Status ReduceGradientToOwners() override { return group().ReduceGradientToOwners(); }
  absl::Status BroadcastWeights() override { return group().BroadcastWeights(); }
  absl::Status GatherWeights() override { return group().GatherWeights(); }

 private:
  Replica* const holder_;
};

// One device: the replicated placement's run on a group of one, without a collective or a choice.
class SingleDevicePlacement final : public ReplicatedPlacement {
 public:
  explicit SingleDevicePlacement(std::unique_ptr<ReplicaGroup> group)
      : ReplicatedPlacement(std::move(group)) {}

  void Take(int64_t tokens, StepDevices& devices) override;
  // The one device's stashes flushed; nothing to reduce or copy.
  absl::Status ReduceGradientToOwners() override { return group().FlushAllStashes(); }
  absl::Status BroadcastWeights() override { return absl::OkStatus(); }
  absl::Status GatherWeights() override { return absl::OkStatus(); }
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_REPLICATED_PLACEMENT_H_
