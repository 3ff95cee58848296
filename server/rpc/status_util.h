// The one place where absl::Status becomes grpc::Status: the layers below the edge speak
// absl::Status only (their macros: common/status_macros.h).
#ifndef LOSSHEAD_SERVER_RPC_STATUS_UTIL_H_
#define LOSSHEAD_SERVER_RPC_STATUS_UTIL_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace losshead::server {

// absl and gRPC share the numeric codes, so the code carries over as is; the message too.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_STATUS_UTIL_H_
