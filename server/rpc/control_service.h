// losshead.v1.ProcessControl (proto/losshead/v1/process_control.proto): what the processes of a
// group send each other (Lead, Apply: group_control.h) and the membership clients read (Members).
// Registered only on a server started with --group_peers.
#ifndef LOSSHEAD_SERVER_RPC_CONTROL_SERVICE_H_
#define LOSSHEAD_SERVER_RPC_CONTROL_SERVICE_H_

#include "grpcpp/grpcpp.h"
#include "losshead/v1/process_control.grpc.pb.h"
#include "server/rpc/service_context.h"

namespace losshead::server {

class ProcessControlService final : public v1::ProcessControl::CallbackService {
 public:
  explicit ProcessControlService(ServiceContext* ctx) : ctx_(ctx) {}

  // Each checks the forwarded token against the LossHead method the request stands for (its
  // role, as if the client had called that method here), then runs on the worker pool.
  grpc::ServerUnaryReactor* Lead(grpc::CallbackServerContext* context,
                                 const v1::ControlRequest* request,
                                 v1::ControlResponse* response) override;
  grpc::ServerUnaryReactor* Apply(grpc::CallbackServerContext* context,
                                  const v1::ControlRequest* request,
                                  v1::ControlResponse* response) override;
  grpc::ServerUnaryReactor* Members(grpc::CallbackServerContext* context,
                                    const v1::MembersRequest* request,
                                    v1::MembersResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

// The LossHead method a control request stands for ("/losshead.v1.LossHead/CreateHead", ...);
// PullGradient with reset counts as a writer's (AuthorizePullReset).
const char* ControlMethod(const v1::ControlRequest& request);

// The caller's `authorization` header ("" when none).
std::string AuthorizationOf(const grpc::CallbackServerContext& context);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_CONTROL_SERVICE_H_
