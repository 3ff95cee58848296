// A micro-batch's copies between the host and one device, in an I/O slot of its own: they run on
// the slot's stream, outside the compute lock, beside another micro-batch's run on that device.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_STAGING_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_STAGING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/engine/device_scratch.h"
#include "server/engine/replica_group.h"
#include "server/engine/result_pool.h"
#include "server/engine/step_prepare.h"

namespace losshead::server {

// Copies `p`'s hidden states (with `hidden`; otherwise the run brings them: PreparedStep::
// hidden_root) and targets into `slot`'s device buffers (grown as needed through `scratch`) and
// waits for them, with room for the results when `outputs` (on a sharded head only shard 0
// returns them). Staged through page-locked memory where the backend has it.
absl::Status StageIn(const PreparedStep& p, Replica& replica, IoSlot& slot, bool outputs,
                     bool hidden, DeviceScratch& scratch);
// Copies dH (into a buffer of `results`, in the head's dtype), the per-token losses and the token
// outputs (laid out as in the slot: token_outputs.h) of a finished run out of `slot`, as `p` wants
// them, and waits for them.
absl::Status StageOut(const PreparedStep& p, Replica& replica, IoSlot& slot, ResultPool& results,
                      std::string* grad_hidden, std::vector<float>* per_token,
                      std::string* token_outputs);
// Whether QueueGradHiddenDelivery applies to `p`: a destination with room for dH, dH wanted, read
// here and in the dtype the run computes it in (a conversion happens on the host).
bool DeliversGradHidden(const PreparedStep& p);
// Queues the copy of the run's dH from `slot` to p.grad_hidden_to on `replica`'s compute stream,
// behind the run that computes it: once the run has landed, dH is there. In stream order, so
// that it waits for no other micro-batch's work (on one device a copy by the multiprocessors
// would wait for the GEMMs of the micro-batch behind, or of a deferred-dW flush, to end).
absl::Status QueueGradHiddenDelivery(const PreparedStep& p, Replica& replica, IoSlot& slot);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_STAGING_H_
