#include "server/engine/placement.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/proto_convert.h"
#include "server/engine/replicated_placement.h"
#include "server/engine/sharded_placement.h"

namespace losshead::server {

bool SpreadPlacement(const v1::Placement& placement) {
  return placement.kind() == v1::PLACEMENT_REPLICATED || placement.kind() == v1::PLACEMENT_SHARDED;
}

int PlacementDevices(const v1::Placement& placement, int available) {
  if (!SpreadPlacement(placement)) return 1;
  return placement.devices() == 0 ? available : static_cast<int>(placement.devices());
}

v1::Placement PlacementOn(const v1::Placement& saved, int k) {
  v1::Placement placed = saved;
  if (k > 1 || SpreadPlacement(saved)) {
    if (saved.kind() != v1::PLACEMENT_SHARDED) placed.set_kind(v1::PLACEMENT_REPLICATED);
    placed.set_devices(static_cast<uint32_t>(k));
  }
  return placed;
}

int64_t HeldRows(const v1::Placement& placement, int64_t vocab_size, int k, int rank) {
  return placement.kind() == v1::PLACEMENT_SHARDED ? kernels::ShardRange(vocab_size, k, rank).size()
                                                   : vocab_size;
}

absl::StatusOr<std::unique_ptr<Placement>> Placement::Create(
    std::span<kernels::Backend* const> devices, const v1::HeadSpec& spec, kernels::DType dtype,
    std::shared_ptr<kernels::ProcessGroup> processes) {
  const int k = static_cast<int>(devices.size());
  const int wanted = PlacementDevices(spec.placement(), k);
  if (wanted != k) {
    return absl::InvalidArgumentError(
        absl::StrCat("the head's placement asks for ", wanted, " devices but ", k, " were given"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(const kernels::MatmulPrecision precision,
                            ToKernel(spec.matmul_precision(), dtype));
  const bool sharded = spec.placement().kind() == v1::PLACEMENT_SHARDED;
  const bool across = sharded && spec.placement().across_processes();
  if (across && processes == nullptr) {
    return absl::FailedPreconditionError(
        "placement.across_processes needs a server of a process group (--group_peers)");
  }
  LOSSHEAD_ASSIGN_OR_RETURN(
      std::unique_ptr<ReplicaGroup> group,
      ReplicaGroup::Create(devices, spec.vocab_size(), spec.hidden_size(), dtype,
                           sharded ? Holding::kOwnRows : Holding::kAllRows, precision,
                           across ? std::move(processes) : nullptr));
  // A sharded head of one device still runs the shard kernels: the layout is the placement's, not
  // the device count's.
  if (sharded) return std::unique_ptr<Placement>(new ShardedPlacement(std::move(group)));
  if (k == 1) return std::unique_ptr<Placement>(new SingleDevicePlacement(std::move(group)));
  return std::unique_ptr<Placement>(new ReplicatedPlacement(std::move(group)));
}

absl::Status Placement::CopyIn(kernels::DeviceBuffer Replica::*tensor, size_t element_bytes,
                               const char* host, int64_t first, int64_t count) const {
  const int64_t d = group_->hidden_size();
  for (Replica* r : WeightHolders()) {
    // The elements this device holds, as [lo, hi) of the V x D tensor, and where they start on it.
    const int64_t held_begin = r->held.begin * d;
    const int64_t held_end = r->held.end * d;
    const int64_t lo = std::max(first, held_begin);
    const int64_t hi = std::min(first + count, held_end);
    if (lo < hi) {
      LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(
          ((*r).*tensor).as<char>() + (lo - held_begin) * element_bytes,
          host + (lo - first) * element_bytes, (hi - lo) * element_bytes, *r->stream));
    }
  }
  return absl::OkStatus();
}

absl::Status Placement::CopyWeightsOut(char* host) const {
  const size_t row_bytes = group_->hidden_size() * kernels::DTypeSize(group_->dtype());
  for (Replica* r : WeightHolders()) {
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(host + r->held.begin * row_bytes,
                                                   r->weights.data(), r->held.size() * row_bytes,
                                                   *r->stream));
  }
  return absl::OkStatus();
}

absl::Status Placement::SynchronizeHolders() const {
  absl::Status first;
  for (Replica* r : WeightHolders()) first.Update(r->stream->Synchronize());
  return first;
}

}  // namespace losshead::server
