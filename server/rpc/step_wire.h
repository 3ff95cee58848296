// Step responses as gRPC byte buffers, for the Step method registered raw (server/rpc/service.h).
//
// The messages are those BuildStepResponses makes, byte for byte once parsed, but dH and the
// per-token losses are not copied into them: each payload field is a slice that references the
// outcome (which the slice keeps alive), framed by a few bytes of protobuf encoding. A typed
// message would cost two copies of every dH byte before gRPC sees it (into the message's bytes
// field, then into the serialised slices); this costs none.
#ifndef LOSSHEAD_SERVER_RPC_STEP_WIRE_H_
#define LOSSHEAD_SERVER_RPC_STEP_WIRE_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/step_outcome.h"

namespace losshead::server {

std::vector<grpc::ByteBuffer> EncodeStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes, bool grad_hidden_shared = false);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_STEP_WIRE_H_
