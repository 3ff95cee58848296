#include "server/rpc/service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/durability/checkpointer.h"
#include "server/rpc/control_service.h"
#include "server/rpc/group_control.h"
#include "server/rpc/status_util.h"
#include "server/rpc/step_reactor.h"
#include "server/rpc/transfer_reactors.h"
#include "server/rpc/unary_call.h"
#include "server/security/auth.h"

#ifndef LOSSHEAD_VERSION
#define LOSSHEAD_VERSION "unknown"
#endif

namespace losshead::server {

bool LossHeadService::RunInGroup(grpc::CallbackServerContext* context,
                                 grpc::ServerUnaryReactor* reactor, const char* method,
                                 absl::Time start, v1::ControlRequest control,
                                 std::function<void(const v1::ControlResponse&)> answer) {
  if (ctx_->group == nullptr) return false;
  ctx_->pool->Schedule([this, reactor, method, start, control = std::move(control),
                        answer = std::move(answer), authorization = AuthorizationOf(*context)] {
    absl::StatusOr<v1::ControlResponse> done = ctx_->group->Run(control, authorization);
    if (done.ok()) {
      answer(*done);
      RefreshMemoryMetrics();
    }
    FinishUnary(ctx_, reactor, method, start, done.status());
  });
  return true;
}

grpc::ServerUnaryReactor* LossHeadService::CreateHead(grpc::CallbackServerContext* context,
                                                      const v1::CreateHeadRequest* request,
                                                      v1::HeadInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "CreateHead", start)) return reactor;
  v1::ControlRequest control;
  *control.mutable_create_head() = *request;
  if (RunInGroup(context, reactor, "CreateHead", start, std::move(control),
                 [response](const v1::ControlResponse& r) { *response = r.head(); })) {
    return reactor;
  }
  // Allocation and the normal init of a large W take long: keep them off the gRPC threads.
  ctx_->pool->Schedule([this, reactor, request, response, start] {
    absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Create(request->spec());
    if (head.ok()) {
      *response = (*head)->Info();
      RefreshMemoryMetrics();
    }
    FinishUnary(ctx_, reactor, "CreateHead", start, head.status());
  });
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::GetHead(grpc::CallbackServerContext* context,
                                                   const v1::GetHeadRequest* request,
                                                   v1::HeadInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "GetHead", start)) return reactor;
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(request->name());
  if (head.ok()) *response = (*head)->Info();
  FinishUnary(ctx_, reactor, "GetHead", start, head.status());
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::ListHeads(grpc::CallbackServerContext* context,
                                                     const v1::ListHeadsRequest* /*request*/,
                                                     v1::ListHeadsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "ListHeads", start)) return reactor;
  for (const auto& head : ctx_->registry->List()) *response->add_heads() = head->Info();
  FinishUnary(ctx_, reactor, "ListHeads", start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::DeleteHead(grpc::CallbackServerContext* context,
                                                      const v1::DeleteHeadRequest* request,
                                                      v1::DeleteHeadResponse* /*response*/) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "DeleteHead", start)) return reactor;
  v1::ControlRequest control;
  *control.mutable_delete_head() = *request;
  if (RunInGroup(context, reactor, "DeleteHead", start, std::move(control),
                 [](const v1::ControlResponse&) {})) {
    return reactor;
  }
  // With checkpoints, its file goes too: otherwise the head would come back at the next start.
  absl::Status status = ctx_->checkpointer != nullptr
                            ? ctx_->checkpointer->DeleteHead(request->name())
                            : ctx_->registry->Delete(request->name());
  if (status.ok()) {
    ctx_->metrics->RemoveHead(request->name());
    ctx_->metrics->Heads(ctx_->registry->size());
  }
  FinishUnary(ctx_, reactor, "DeleteHead", start, status);
  return reactor;
}

grpc::ServerUnaryReactor* LossHeadService::SetLossOptions(grpc::CallbackServerContext* context,
                                                          const v1::SetLossOptionsRequest* request,
                                                          v1::HeadInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "SetLossOptions", start)) return reactor;
  v1::ControlRequest control;
  *control.mutable_set_loss_options() = *request;
  if (RunInGroup(context, reactor, "SetLossOptions", start, std::move(control),
                 [response](const v1::ControlResponse& r) { *response = r.head(); })) {
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(request->name());
  absl::Status status = head.status();
  if (status.ok()) status = (*head)->SetDefaultOptions(request->default_options());
  if (status.ok()) *response = (*head)->Info();
  FinishUnary(ctx_, reactor, "SetLossOptions", start, status);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* LossHeadService::Step(
    grpc::CallbackServerContext* context) {
  return new StepReactor(ctx_, context);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossHeadService::PullGradient(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return StartPullGradient(ctx_, request,
                           AuthorizePullReset(ctx_->tokens, context->client_metadata()),
                           AuthorizationOf(*context));
}

grpc::ServerReadReactor<v1::PushWeightsRequest>* LossHeadService::PushWeights(
    grpc::CallbackServerContext* context, v1::PushWeightsResponse* response) {
  return StartPushWeights(ctx_, response, AuthorizationOf(*context));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossHeadService::DownloadWeights(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return StartDownloadWeights(ctx_, request, AuthorizationOf(*context));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossHeadService::EmbeddingRows(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return StartEmbeddingRows(ctx_, request, AuthorizationOf(*context));
}

grpc::ServerUnaryReactor* LossHeadService::GetStats(grpc::CallbackServerContext* context,
                                                    const v1::GetStatsRequest* /*request*/,
                                                    v1::Stats* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (RefuseWhileDraining(ctx_, reactor, "GetStats", start)) return reactor;
  for (const kernels::Backend* backend : ctx_->devices) {
    const kernels::MemoryInfo memory = backend->memory_info();
    v1::DeviceStats* device = response->add_devices();
    device->set_backend(std::string(backend->name()));
    device->set_name(backend->device_description());
    device->set_memory_total_bytes(memory.total_bytes);
    device->set_memory_free_bytes(memory.free_bytes);
  }
  *response->mutable_device() = response->devices(0);
  for (const auto& head : ctx_->registry->List()) *response->add_heads() = head->Info();
  response->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - ctx_->start_time));
  response->set_inflight_microbatches(std::max<int64_t>(0, ctx_->metrics->inflight()));
  response->set_max_message_bytes(ctx_->max_message_bytes);
  response->set_version(LOSSHEAD_VERSION);
  if (ctx_->admission != nullptr) {
    response->set_admitted_microbatches(ctx_->admission->microbatches());
    response->set_reserved_bytes(ctx_->admission->bytes());
  }
  if (ctx_->shared_regions != nullptr) {
    response->mutable_same_node()->set_host_id(ctx_->host_id);
    response->mutable_same_node()->set_socket(ctx_->same_node_socket);
    for (const IpcDevice& d : ctx_->shared_regions->devices()) {
      v1::SameNodeDevice* device = response->mutable_same_node()->add_devices();
      device->set_index(d.index);
      device->set_pci_bus_id(d.pci_bus_id);
    }
  }
  FinishUnary(ctx_, reactor, "GetStats", start, absl::OkStatus());
  return reactor;
}

void LossHeadService::RefreshMemoryMetrics() const {
  std::vector<DeviceMemory> per_device(ctx_->devices.size());
  size_t count = 0;
  for (const auto& head : ctx_->registry->List()) {
    const OptimizerFootprint optimizer = head->optimizer_bytes();
    const DeviceMemory memory{.weights = head->weights_bytes(),
                              .gradient = head->gradient_bytes(),
                              .workspace = head->workspace_bytes(),
                              .master_weights = optimizer.master,
                              .optimizer_state = optimizer.state};
    ctx_->metrics->HeadMemory(head->name(), memory);
    ctx_->metrics->HeadDevices(head->name(), head->device_count());
    const Head::WindowState window = head->Window();
    ctx_->metrics->HeadWindow(head->name(), window.microbatches, window.tokens, window.age);
    const v1::HeadInfo info = head->Info();  // the state lock only, briefly: never a device wait
    ctx_->metrics->HeadTraining(head->name(), info.weights_version(), info.optimizer_step());
    for (const Head::DeviceShare& share : head->MemoryByDevice()) {
      const auto at = std::find(ctx_->devices.begin(), ctx_->devices.end(), share.device);
      if (at == ctx_->devices.end()) continue;  // heads are only ever placed on these
      DeviceMemory& device = per_device[at - ctx_->devices.begin()];
      device.weights += share.memory.weights_bytes();
      device.gradient += share.memory.gradient_bytes();
      device.workspace += share.memory.workspace_bytes();
      device.master_weights += share.memory.master_weights_bytes();
      device.optimizer_state += share.memory.optimizer_state_bytes();
    }
    ++count;
  }
  for (size_t i = 0; i < ctx_->devices.size(); ++i) {
    const kernels::MemoryInfo memory = ctx_->devices[i]->memory_info();
    per_device[i].free = memory.free_bytes;
    per_device[i].total = memory.total_bytes;
    ctx_->metrics->DeviceMemoryBytes(DeviceLabel(*ctx_->devices[i], i), per_device[i]);
  }
  if (ctx_->shared_regions != nullptr) {
    ctx_->metrics->SharedMemoryMapped(ctx_->shared_regions->mapped_regions(),
                                      ctx_->shared_regions->mapped_bytes());
  }
  ctx_->metrics->HostBufferBytes(ctx_->pinned != nullptr ? ctx_->pinned->held_bytes() : 0,
                                 ctx_->pinned != nullptr ? ctx_->pinned->idle_bytes() : 0,
                                 ctx_->results != nullptr ? ctx_->results->idle_bytes() : 0);
  ctx_->metrics->Heads(count);
  if (ctx_->remembered != nullptr) {
    const IdempotencyBudget::Usage usage = ctx_->remembered->usage();
    std::vector<std::pair<std::string, uint64_t>> evictions;
    for (size_t c = 0; c < IdempotencyBudget::kCauses; ++c) {
      evictions.emplace_back(IdempotencyBudget::CauseName(static_cast<IdempotencyBudget::Cause>(c)),
                             usage.evictions[c]);
    }
    ctx_->metrics->RememberedResults(usage.results, usage.bytes, evictions);
  }
}

}  // namespace losshead::server
