// The one place where gRPC statuses become absl statuses.
#ifndef LOSSHEAD_CLIENT_STATUS_H_
#define LOSSHEAD_CLIENT_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace losshead::client {

// Keeps the code (both enums share gRPC's numbering) and the message, with one exception.
// CANCELLED on a call that this client did not cancel (`cancelled_here` false) becomes
// UNAVAILABLE: gRPC's server cancels the calls it will not run while it shuts down (those that
// reach it after its Shutdown began, before a handler took them, and those still running at
// the shutdown deadline), and the client then sees CANCELLED, a code that promises the caller
// cancelled (grpc/grpc issue 41785). To the caller that is the server going away, which is
// what UNAVAILABLE says and what the retry policy acts on. The message keeps the original.
absl::Status FromGrpcStatus(const grpc::Status& status, bool cancelled_here = false);

// A per-micro-batch error as carried in StepResponse.error: the same numbering.
absl::Status FromCodeAndMessage(int code, const std::string& message);

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_STATUS_H_
