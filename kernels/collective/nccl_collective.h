// The collectives of CUDA backends over NCCL: one communicator per device, all in this process
// (ncclCommInitAll) or spread over the processes of a group (ncclCommInitRank), every call issued
// by one thread for every local rank inside one NCCL group.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_

#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"

namespace losshead::kernels {

// The collective over distinct CUDA devices, rank r on devices[r]. Turns NVLink multicast off for
// the process (NCCL_NVLS_ENABLE=0, unless the environment already sets it) before the
// communicators exist. INVALID_ARGUMENT for a device that is not visible; INTERNAL (or
// INVALID_ARGUMENT, for what NCCL refuses as such) with NCCL's message when the communicators
// cannot be created.
absl::StatusOr<std::unique_ptr<Collective>> CreateNcclCollective(std::span<const int> devices);

// Turns NVLink multicast off (as above) and checks that every device is visible: INVALID_ARGUMENT
// otherwise. What a process checks of its own devices before it joins a group's collective.
absl::Status CheckNcclDevices(std::span<const int> devices);

// The collective over the local `devices` (distinct, checked with CheckNcclDevices) of every
// process of `group`; first[p] is process p's first global rank, first.back() the number of ranks.
// A collective call of the group: global rank 0 makes the NCCL unique id, the group's TCP
// connections hand it out, and every process initialises its communicators with ncclCommInitRank
// in one NCCL group. The group's errors (UNAVAILABLE) when the id cannot be handed out; INTERNAL
// with NCCL's message when the communicators cannot be created. A watchdog thread aborts the
// communicators when a call's work has not finished within the group's op timeout or NCCL reports
// an asynchronous error: that call's results are lost, every later call is UNAVAILABLE, and the
// group is shut down (its peers' exchanges fail at once).
absl::StatusOr<std::unique_ptr<Collective>> CreateProcessNcclCollective(
    std::shared_ptr<ProcessGroup> group, std::span<const int> devices, std::vector<int> first);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_
