// The collective of backends whose memory the host cannot read, staged through host memory: each
// call waits for every rank's stream, copies the ranks' buffers to the host, runs the host
// collective on the copies (its sums: fp64 in rank order, rounded once) and copies the results
// back. Synchronous and slow, so it is what CreateCollective gives only where NCCL cannot serve:
// several CUDA backends on one device, the way to run a head placed over k ranks on a machine with
// one GPU (the GPU suite's placed heads when fewer devices are visible).
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_STAGED_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_STAGED_COLLECTIVE_H_

#include <memory>
#include <span>

#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"

namespace losshead::kernels {

// Rank r is backends[r] (non-null; the same backend may appear more than once). Buffers and
// streams passed to the calls must be that rank's backend's.
std::unique_ptr<Collective> CreateStagedCollective(std::span<Backend* const> backends);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_STAGED_COLLECTIVE_H_
