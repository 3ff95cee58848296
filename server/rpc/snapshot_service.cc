// The named-snapshot RPCs of LossHeadService: RestoreHead, DeleteSnapshot and ListSnapshots (a
// Checkpoint with a tag writes a snapshot: checkpoint_service.cc). The files are the
// checkpointer's (server/durability/checkpointer.h); in a process group, each process's part,
// through the leader (GroupControl's snapshots, server/durability/group_snapshots.h).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/durability/checkpointer.h"
#include "server/rpc/control_service.h"
#include "server/rpc/group_control.h"
#include "server/rpc/service.h"
#include "server/rpc/unary_call.h"

namespace losshead::server {
namespace {

// What every snapshot call checks before it touches anything, in this order: the server is not
// stopping, the head name and tag are well formed (`tag` null: a call without one), and the server
// keeps checkpoints. OK: the call may go on.
absl::Status Admit(const ServiceContext& ctx, const std::string& head, const std::string* tag) {
  if (ctx.draining.load()) return absl::UnavailableError("the server is shutting down");
  if (absl::Status s = Head::ValidateName(head); !s.ok()) return s;
  if (tag != nullptr) {
    if (absl::Status s = Checkpointer::ValidateTag(*tag); !s.ok()) return s;
  }
  if (ctx.group != nullptr) {
    // Across processes: one request through the leader (group_control.h), which checks that the
    // processes keep checkpoints.
    return absl::OkStatus();
  }
  if (ctx.checkpointer == nullptr) {
    return absl::FailedPreconditionError(
        "snapshots need checkpoints, which are disabled (no --checkpoint_dir)");
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* LossHeadService::RestoreHead(grpc::CallbackServerContext* context,
                                                       const v1::RestoreHeadRequest* request,
                                                       v1::HeadInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Admit(*ctx_, request->head(), &request->tag()); !s.ok()) {
    FinishUnary(ctx_, reactor, "RestoreHead", start, s);
    return reactor;
  }
  if (ctx_->group != nullptr) {
    // Waits for every process: off the gRPC threads.
    ctx_->pool->Schedule(
        [this, reactor, request, response, start, authorization = AuthorizationOf(*context)] {
          absl::StatusOr<v1::HeadInfo> info =
              ctx_->group->RestoreSnapshot(request->head(), request->tag(), authorization);
          if (info.ok()) {
            *response = std::move(*info);
            RefreshMemoryMetrics();
          }
          FinishUnary(ctx_, reactor, "RestoreHead", start, info.status());
        });
    return reactor;
  }
  // Reads the file and fills device memory: off the gRPC threads.
  ctx_->pool->Schedule([this, reactor, request, response, start] {
    absl::StatusOr<std::shared_ptr<Head>> head =
        ctx_->checkpointer->RestoreSnapshot(request->head(), request->tag());
    if (head.ok()) {
      *response = (*head)->Info();
      RefreshMemoryMetrics();
    }
    FinishUnary(ctx_, reactor, "RestoreHead", start, head.status());
  });
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::DeleteSnapshot(
    grpc::CallbackServerContext* context, const v1::DeleteSnapshotRequest* request,
    v1::DeleteSnapshotResponse* /*response*/) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Admit(*ctx_, request->head(), &request->tag()); !s.ok()) {
    FinishUnary(ctx_, reactor, "DeleteSnapshot", start, s);
    return reactor;
  }
  if (ctx_->group != nullptr) {
    ctx_->pool->Schedule(
        [this, reactor, request, start, authorization = AuthorizationOf(*context)] {
          FinishUnary(ctx_, reactor, "DeleteSnapshot", start,
                      ctx_->group->DeleteSnapshot(request->head(), request->tag(), authorization));
        });
    return reactor;
  }
  // Waits for a checkpoint write in progress (they are serialised): off the gRPC threads.
  ctx_->pool->Schedule([this, reactor, request, start] {
    FinishUnary(ctx_, reactor, "DeleteSnapshot", start,
                ctx_->checkpointer->DeleteSnapshot(request->head(), request->tag()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::ListSnapshots(grpc::CallbackServerContext* context,
                                                         const v1::ListSnapshotsRequest* request,
                                                         v1::ListSnapshotsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Admit(*ctx_, request->head(), nullptr); !s.ok()) {
    FinishUnary(ctx_, reactor, "ListSnapshots", start, s);
    return reactor;
  }
  // Reads a header per snapshot (in a group: the leader's manifests): off the gRPC threads.
  ctx_->pool->Schedule(
      [this, reactor, request, response, start, authorization = AuthorizationOf(*context)] {
        absl::StatusOr<std::vector<v1::SnapshotInfo>> listed =
            ctx_->group != nullptr ? ctx_->group->ListSnapshots(request->head(), authorization)
                                   : ctx_->checkpointer->ListSnapshots(request->head());
        if (listed.ok()) {
          for (v1::SnapshotInfo& info : *listed) *response->add_snapshots() = std::move(info);
        }
        FinishUnary(ctx_, reactor, "ListSnapshots", start, listed.status());
      });
  return reactor;
}

}  // namespace losshead::server
