// A micro-batch's hidden states and targets that lie in a client's device region
// (docs/same-node.md, "The device path"), taken out of it when the micro-batch is picked to run
// rather than when its header is admitted: the copy runs on a worker, outside the Step stream's
// lock, so that the stream's next messages are read and admitted meanwhile. Free of gRPC.
//
// Invariants:
// - What TakeRegionInput fills in is what StepAssembler assembles from the same bytes received in
//   messages: the hidden states, the targets, their digests (for a key the server may remember:
//   a client id, not forward-only) and the largest |h| in the header's dtype. So a repeat matches
//   its first answer whichever path each took (request_fingerprint.h).
// - What is checked, digested and computed is the server's own copy: a client writing its region
//   meanwhile changes nothing but its own input.
// - A refusal leaves the micro-batch as it was: it is answered with the refusal, nothing computed
//   or counted, and the client may send it again.
#ifndef LOSSHEAD_SERVER_RPC_REGION_INPUT_H_
#define LOSSHEAD_SERVER_RPC_REGION_INPUT_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "server/engine/micro_batch.h"
#include "server/engine/pinned_pool.h"
#include "server/rpc/shared_regions.h"

namespace losshead::server {

// The ranges of a region that a header's reference named, checked against the region at
// admission (StepReactor::ResolveSharedLocked).
struct RegionInput {
  std::shared_ptr<SharedRegion> region;  // null: the tensors came another way
  uint64_t hidden_offset = 0;
  uint64_t hidden_bytes = 0;
  uint64_t targets_offset = 0;
  uint64_t targets_bytes = 0;
};

// Copies `input`'s hidden states and targets into `mb` (whose header is set), the hidden states
// into page-locked memory from `pinned` where it gives some (else ordinary memory), and takes
// their digests and largest |h| as they land. Refusals, `mb` unchanged:
// - NOT_FOUND: the region was unregistered (its client closed its connection, or exited) since
//   the header was admitted;
// - INVALID_ARGUMENT: `mb` holds hidden states or targets from its messages too;
// - INTERNAL: the copy out of the device failed (the driver's error named).
// A host region (a memfd) is copied the same way; the reactor takes those at admission.
absl::Status TakeRegionInput(const RegionInput& input, PinnedPool* pinned, MicroBatch& mb);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_REGION_INPUT_H_
