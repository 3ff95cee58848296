// SetOptimizer and ApplyOptimizer. Both are retried: a repeated SetOptimizer sets the same
// optimizer afresh again before any apply of this caller, and a repeated ApplyOptimizer carries
// its (client_id, step_key), which the server answers from its record instead of stepping twice.
#include <grpcpp/grpcpp.h>

#include "losshead/client/client.h"
#include "losshead/client/status.h"

namespace losshead::client {

absl::StatusOr<v1::HeadInfo> Client::SetOptimizer(const std::string& head,
                                                  const v1::OptimizerSpec& optimizer) {
  v1::SetOptimizerRequest request;
  request.set_head(head);
  *request.mutable_optimizer() = optimizer;
  v1::HeadInfo info;
  const absl::Status status = RunWithRetry([&] {
    auto context = NewContext(options_.deadline);
    return FromGrpcStatus(stub_->SetOptimizer(context.get(), request, &info));
  });
  if (!status.ok()) return status;
  return info;
}

absl::StatusOr<v1::ApplyOptimizerResponse> Client::ApplyOptimizer(
    const v1::ApplyOptimizerRequest& request) {
  if (request.client_id().empty() || request.step_key() < 1) {
    return absl::InvalidArgumentError(
        "ApplyOptimizer needs a client_id and a step_key >= 1 (its exactly-once key)");
  }
  v1::ApplyOptimizerResponse response;
  const absl::Status status = RunWithRetry([&] {
    auto context = NewContext(options_.deadline);
    return FromGrpcStatus(stub_->ApplyOptimizer(context.get(), request, &response));
  });
  if (!status.ok()) return status;
  return response;
}

}  // namespace losshead::client
