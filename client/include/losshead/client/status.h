// The one place where gRPC statuses become absl statuses.
#ifndef LOSSHEAD_CLIENT_STATUS_H_
#define LOSSHEAD_CLIENT_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace losshead::client {

// Keeps the code (both enums share gRPC's numbering) and the message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A per-micro-batch error as carried in StepResponse.error: the same numbering.
absl::Status FromCodeAndMessage(int code, const std::string& message);

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_STATUS_H_
