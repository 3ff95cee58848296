// The collectives of CPU backends spread over the processes of a group, through the group's TCP
// connections. Bit-exact against the one-process host collective over the same global ranks: every
// element is reduced by one process from every rank's value, in fp64 and global rank order, and
// rounded once. Each call exchanges a header with every peer first (call_header.h), then moves
// only what each process needs; results are written once every exchange has succeeded, so a call
// that fails leaves the buffers untouched.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_PROCESS_HOST_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_PROCESS_HOST_COLLECTIVE_H_

#include <memory>
#include <vector>

#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"

namespace losshead::kernels {

// first[p] is the global rank of process p's first local rank, for p in [0, group->size()], with
// first[group->size()] the number of ranks; this process drives [first[rank], first[rank + 1]).
std::unique_ptr<Collective> CreateProcessHostCollective(std::shared_ptr<ProcessGroup> group,
                                                        std::vector<int> first);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_PROCESS_HOST_COLLECTIVE_H_
