// Checkpoint and GetClientProgress: unary calls, both safe to repeat.
#include <grpcpp/grpcpp.h>

#include "losshead/client/client.h"
#include "losshead/client/status.h"

namespace losshead::client {

absl::StatusOr<v1::CheckpointResponse> Client::Checkpoint(const std::string& head) {
  v1::CheckpointRequest request;
  request.set_head(head);
  v1::CheckpointResponse response;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->Checkpoint(context.get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ClientProgress> Client::GetClientProgress(const std::string& head,
                                                             const std::string& client_id) {
  v1::GetClientProgressRequest request;
  request.set_head(head);
  request.set_client_id(client_id);
  v1::ClientProgress response;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->GetClientProgress(context.get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace losshead::client
