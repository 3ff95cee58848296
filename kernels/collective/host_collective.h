// The collectives of CPU backends: plain loops over host memory, run inline in the calling thread
// as every CPU backend call is. Exact and deterministic: sums in fp64 in rank order, rounded once.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_HOST_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_HOST_COLLECTIVE_H_

#include <memory>

#include "losshead/kernels/collective.h"

namespace losshead::kernels {

// The collective over `size` >= 1 ranks of CPU backends.
std::unique_ptr<Collective> CreateHostCollective(int size);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_HOST_COLLECTIVE_H_
