#include "server/rpc/control_service.h"

#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/rpc/group_control.h"
#include "server/rpc/unary_call.h"
#include "server/security/auth.h"
#include "server/security/group_secret.h"

namespace losshead::server {
namespace {

// Who may send a process control: with a group secret, the group's processes only, by its
// credential (the process whose client sent the request checked that client's token, whatever
// its role, before forwarding it); without one, the forwarded token, with the role the method it
// stands for needs.
absl::Status AuthorizeControl(ServiceContext* ctx, const grpc::CallbackServerContext& context,
                              const v1::ControlRequest& request) {
  if (ctx->group == nullptr) {
    return absl::FailedPreconditionError("this server is not part of a process group");
  }
  if (ctx->group_secret != nullptr) {
    const std::string authorization = AuthorizationOf(context);
    if (ctx->group_secret->Matches(authorization)) return absl::OkStatus();
    if (authorization.empty()) {
      return absl::UnauthenticatedError(
          "ProcessControl.Lead and Apply need the group's credential (--group_secret_file)");
    }
    return absl::PermissionDeniedError(
        "ProcessControl.Lead and Apply are for the group's processes: they take the group's "
        "credential (--group_secret_file) and no client's token, whatever its role");
  }
  LOSSHEAD_RETURN_IF_ERROR(
      AuthorizeOpenCall(ctx->tokens, ControlMethod(request), context.client_metadata()));
  if (request.has_pull_gradient() && request.pull_gradient().reset()) {
    return AuthorizePullReset(ctx->tokens, context.client_metadata());
  }
  return absl::OkStatus();
}

}  // namespace

const char* ControlMethod(const v1::ControlRequest& request) {
  switch (request.op_case()) {
    case v1::ControlRequest::kCreateHead:
      return "/losshead.v1.LossHead/CreateHead";
    case v1::ControlRequest::kDeleteHead:
      return "/losshead.v1.LossHead/DeleteHead";
    case v1::ControlRequest::kSetLossOptions:
      return "/losshead.v1.LossHead/SetLossOptions";
    case v1::ControlRequest::kSetOptimizer:
      return "/losshead.v1.LossHead/SetOptimizer";
    case v1::ControlRequest::kApplyOptimizer:
      return "/losshead.v1.LossHead/ApplyOptimizer";
    case v1::ControlRequest::kPullGradient:
      return "/losshead.v1.LossHead/PullGradient";
    case v1::ControlRequest::kPushWeights:
      return "/losshead.v1.LossHead/PushWeights";
    case v1::ControlRequest::kCheckpoint:
    case v1::ControlRequest::kCheckpointCommit:
      return "/losshead.v1.LossHead/Checkpoint";
    case v1::ControlRequest::kStep:
      return "/losshead.v1.LossHead/Step";
    case v1::ControlRequest::kDownloadWeights:
      return "/losshead.v1.LossHead/DownloadWeights";
    case v1::ControlRequest::kLeaving:
      return "/losshead.v1.LossHead/Checkpoint";
    case v1::ControlRequest::kSnapshot:
      switch (request.snapshot().action()) {
        case v1::SnapshotControl::SNAPSHOT_RESTORE:
          return "/losshead.v1.LossHead/RestoreHead";
        case v1::SnapshotControl::SNAPSHOT_DELETE:
          return "/losshead.v1.LossHead/DeleteSnapshot";
        case v1::SnapshotControl::SNAPSHOT_LIST:
          return "/losshead.v1.LossHead/ListSnapshots";
        default:  // a take, and a failed take's clean-up
          return "/losshead.v1.LossHead/Checkpoint";
      }
    default:
      return "/losshead.v1.LossHead/CreateHead";  // the writer's role: nothing is run anyway
  }
}

std::string AuthorizationOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

grpc::ServerUnaryReactor* ProcessControlService::Lead(grpc::CallbackServerContext* context,
                                                      const v1::ControlRequest* request,
                                                      v1::ControlResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // A process stopping in order announces it while its peers drain too (GroupControl::Leave).
  if (!request->has_leaving() && RefuseWhileDraining(ctx_, reactor, "Lead", start)) return reactor;
  if (absl::Status auth = AuthorizeControl(ctx_, *context, *request); !auth.ok()) {
    FinishUnary(ctx_, reactor, "Lead", start, auth);
    return reactor;
  }
  if (!ctx_->group->leader()) {
    FinishUnary(ctx_, reactor, "Lead", start,
                absl::FailedPreconditionError("only process 0 leads the group"));
    return reactor;
  }
  // A thread of its own, not the worker pool: it waits for the followers, whose clients' control
  // requests may hold pool threads waiting for this one.
  std::thread([this, reactor, request, response, start, authorization = AuthorizationOf(*context)] {
    absl::StatusOr<v1::ControlResponse> led =
        ctx_->group->Lead(*request, authorization, /*pulled=*/nullptr);
    if (led.ok()) *response = *std::move(led);
    FinishUnary(ctx_, reactor, "Lead", start, led.status());
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* ProcessControlService::Apply(grpc::CallbackServerContext* context,
                                                       const v1::ControlRequest* request,
                                                       v1::ControlResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The final checkpoint set is taken while every process drains (GroupControl::Leave).
  const bool final_set = request->has_checkpoint() || request->has_checkpoint_commit();
  if (!final_set && RefuseWhileDraining(ctx_, reactor, "Apply", start)) return reactor;
  if (absl::Status auth = AuthorizeControl(ctx_, *context, *request); !auth.ok()) {
    FinishUnary(ctx_, reactor, "Apply", start, auth);
    return reactor;
  }
  // A thread of its own, as Lead's: this process's clients' control requests may hold every pool
  // thread while they wait for the leader, which waits for this.
  std::thread([this, reactor, request, response, start] {
    absl::StatusOr<v1::ControlResponse> applied = ctx_->group->Apply(*request);
    if (applied.ok()) *response = *std::move(applied);
    FinishUnary(ctx_, reactor, "Apply", start, applied.status());
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* ProcessControlService::Members(grpc::CallbackServerContext* context,
                                                         const v1::MembersRequest* /*request*/,
                                                         v1::MembersResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (ctx_->group == nullptr) {
    FinishUnary(ctx_, reactor, "Members", start,
                absl::FailedPreconditionError("this server is not part of a process group"));
    return reactor;
  }
  for (const std::string& address : ctx_->group->addresses()) response->add_addresses(address);
  response->set_rank(ctx_->group->rank());
  response->set_home_rule("fnv1a64 mod N");
  FinishUnary(ctx_, reactor, "Members", start, absl::OkStatus());
  return reactor;
}

}  // namespace losshead::server
