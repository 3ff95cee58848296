// The collectives of CUDA backends over NCCL: one communicator per device, all in this process
// (ncclCommInitAll), every call issued by one thread for every rank inside one NCCL group.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_

#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "losshead/kernels/collective.h"

namespace losshead::kernels {

// The collective over distinct CUDA devices, rank r on devices[r]. Turns NVLink multicast off for
// the process (NCCL_NVLS_ENABLE=0, unless the environment already sets it) before the
// communicators exist. INVALID_ARGUMENT for a device that is not visible; INTERNAL (or
// INVALID_ARGUMENT, for what NCCL refuses as such) with NCCL's message when the communicators
// cannot be created.
absl::StatusOr<std::unique_ptr<Collective>> CreateNcclCollective(std::span<const int> devices);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_NCCL_COLLECTIVE_H_
