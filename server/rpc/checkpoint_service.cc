// The Checkpoint and GetClientProgress RPCs of LossHeadService.
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/durability/checkpointer.h"
#include "server/rpc/control_service.h"
#include "server/rpc/group_control.h"
#include "server/rpc/service.h"
#include "server/rpc/unary_call.h"

namespace losshead::server {
grpc::ServerUnaryReactor* LossHeadService::Checkpoint(grpc::CallbackServerContext* context,
                                                      const v1::CheckpointRequest* request,
                                                      v1::CheckpointResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (ctx_->draining.load()) {
    // Shutdown writes the final checkpoint itself, after the drain.
    FinishUnary(ctx_, reactor, "Checkpoint", start,
                absl::UnavailableError("the server is shutting down"));
    return reactor;
  }
  const bool tagged = !request->tag().empty();
  if (tagged) {
    // A named snapshot is of one head (server/rpc/snapshot_service.cc has the rest of them).
    absl::Status valid =
        request->head().empty()
            ? absl::InvalidArgumentError("a snapshot tag needs one head; `head` is empty")
            : Checkpointer::ValidateTag(request->tag());
    if (valid.ok()) valid = Head::ValidateName(request->head());
    if (!valid.ok()) {
      FinishUnary(ctx_, reactor, "Checkpoint", start, valid);
      return reactor;
    }
  }
  if (ctx_->group != nullptr) {
    // Across processes a checkpoint is a set of every process's part, one global cut through the
    // leader (server/durability/group_checkpoint.h); a named snapshot is one head's, each process
    // holding its part (server/durability/group_snapshots.h).
    if (tagged) {
      ctx_->pool->Schedule(
          [this, reactor, request, response, start, authorization = AuthorizationOf(*context)] {
            absl::StatusOr<v1::SnapshotInfo> snapshot =
                ctx_->group->TakeSnapshot(request->head(), request->tag(), authorization);
            if (snapshot.ok()) *response->mutable_snapshot() = std::move(*snapshot);
            FinishUnary(ctx_, reactor, "Checkpoint", start, snapshot.status());
          });
      return reactor;
    }
    ctx_->pool->Schedule(
        [this, reactor, request, response, start, authorization = AuthorizationOf(*context)] {
          absl::StatusOr<v1::CheckpointResponse> written =
              ctx_->group->Checkpoint(request->head(), authorization);
          if (written.ok()) *response = std::move(*written);
          FinishUnary(ctx_, reactor, "Checkpoint", start, written.status());
        });
    return reactor;
  }
  if (ctx_->checkpointer == nullptr) {
    FinishUnary(ctx_, reactor, "Checkpoint", start,
                absl::FailedPreconditionError("checkpoints are disabled (no --checkpoint_dir)"));
    return reactor;
  }
  // Copies W and dW out and writes files: keep it off the gRPC threads.
  ctx_->pool->Schedule([this, reactor, request, response, start, tagged] {
    absl::Status status;
    if (tagged) {
      absl::StatusOr<v1::SnapshotInfo> snapshot =
          ctx_->checkpointer->WriteSnapshot(request->head(), request->tag());
      if (snapshot.ok()) *response->mutable_snapshot() = std::move(*snapshot);
      status = snapshot.status();
    } else {
      absl::StatusOr<v1::CheckpointResponse> written = ctx_->checkpointer->Write(request->head());
      if (written.ok()) *response = std::move(*written);
      status = written.status();
    }
    FinishUnary(ctx_, reactor, "Checkpoint", start, status);
  });
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::GetClientProgress(
    grpc::CallbackServerContext* context, const v1::GetClientProgressRequest* request,
    v1::ClientProgress* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (ctx_->draining.load()) {
    FinishUnary(ctx_, reactor, "GetClientProgress", start,
                absl::UnavailableError("the server is shutting down"));
    return reactor;
  }
  absl::Status status;
  if (request->client_id().empty()) {
    status = absl::InvalidArgumentError("client_id must not be empty");
  } else {
    absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(request->head());
    status = head.status();
    if (head.ok()) *response = (*head)->Progress(request->client_id());
  }
  FinishUnary(ctx_, reactor, "GetClientProgress", start, status);
  return reactor;
}

}  // namespace losshead::server
