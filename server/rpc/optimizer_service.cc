// The SetOptimizer and ApplyOptimizer RPCs of LossHeadService. Both touch device memory (an
// allocation and a copy of W, or a pass over W, dW and the state), so they run on the worker pool.
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/rpc/service.h"
#include "server/rpc/unary_call.h"

namespace losshead::server {
grpc::ServerUnaryReactor* LossHeadService::SetOptimizer(grpc::CallbackServerContext* context,
                                                        const v1::SetOptimizerRequest* request,
                                                        v1::HeadInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "SetOptimizer", start)) return reactor;
  v1::ControlRequest control;
  *control.mutable_set_optimizer() = *request;
  if (RunInGroup(context, reactor, "SetOptimizer", start, std::move(control),
                 [response](const v1::ControlResponse& r) { *response = r.head(); })) {
    return reactor;
  }
  ctx_->pool->Schedule([this, reactor, request, response, start] {
    absl::StatusOr<std::shared_ptr<Head>> head =
        ctx_->registry->SetOptimizer(request->head(), request->optimizer());
    if (head.ok()) {
      *response = (*head)->Info();
      RefreshMemoryMetrics();
    }
    FinishUnary(ctx_, reactor, "SetOptimizer", start, head.status());
  });
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::ApplyOptimizer(grpc::CallbackServerContext* context,
                                                          const v1::ApplyOptimizerRequest* request,
                                                          v1::ApplyOptimizerResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "ApplyOptimizer", start)) return reactor;
  v1::ControlRequest control;
  *control.mutable_apply_optimizer() = *request;
  if (RunInGroup(context, reactor, "ApplyOptimizer", start, std::move(control),
                 [response](const v1::ControlResponse& r) { *response = r.apply_optimizer(); })) {
    return reactor;
  }
  ctx_->pool->Schedule([this, reactor, request, response, start] {
    absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(request->head());
    absl::Status status = head.status();
    if (head.ok()) {
      absl::StatusOr<v1::ApplyOptimizerResponse> applied = (*head)->ApplyOptimizer(*request);
      status = applied.status();
      const char* outcome = !applied.ok() ? "error" : applied->replayed() ? "replayed" : "ok";
      ctx_->metrics->OptimizerApply(request->head(), outcome, absl::Now() - start);
      if (applied.ok() && !applied->replayed()) {
        ctx_->metrics->OptimizerNorms(request->head(), applied->head_grad_norm(),
                                      applied->total_grad_norm(), applied->clip_coefficient());
      }
      if (applied.ok()) *response = *std::move(applied);
    }
    FinishUnary(ctx_, reactor, "ApplyOptimizer", start, status);
  });
  return reactor;
}

}  // namespace losshead::server
