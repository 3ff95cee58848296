#include "server/rpc/unary_call.h"

#include "server/rpc/status_util.h"

namespace losshead::server {

void FinishUnary(ServiceContext* ctx, grpc::ServerUnaryReactor* reactor, const char* method,
                 absl::Time start, const absl::Status& status) {
  ctx->metrics->RpcFinished(method, static_cast<int>(status.code()), absl::Now() - start);
  reactor->Finish(ToGrpcStatus(status));
}

bool RefuseWhileDraining(ServiceContext* ctx, grpc::ServerUnaryReactor* reactor, const char* method,
                         absl::Time start) {
  if (!ctx->draining.load()) return false;
  FinishUnary(ctx, reactor, method, start, absl::UnavailableError("the server is shutting down"));
  return true;
}

}  // namespace losshead::server
