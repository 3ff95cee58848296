// losshead.v1.LossHead on the gRPC callback API. Unary calls that only read state answer inline;
// everything that allocates or copies device memory runs on the worker pool.
#ifndef LOSSHEAD_SERVER_RPC_SERVICE_H_
#define LOSSHEAD_SERVER_RPC_SERVICE_H_

#include <functional>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "losshead/v1/process_control.pb.h"
#include "server/rpc/service_context.h"

namespace losshead::server {

// LossHead::CallbackService with Step, PullGradient, DownloadWeights and EmbeddingRows registered raw (byte
// buffers): their responses reference dH or the tensor's snapshot rather than copy it into
// messages (server/rpc/step_wire.h, transfer_reactors.h). Every method must be listed: one left
// out would answer UNIMPLEMENTED.
// The named-snapshot methods (snapshot_service.cc), innermost.
using LossHeadSnapshotMethods =
    v1::LossHead::WithCallbackMethod_RestoreHead<v1::LossHead::WithCallbackMethod_DeleteSnapshot<
        v1::LossHead::WithCallbackMethod_ListSnapshots<v1::LossHead::Service>>>;
using LossHeadServiceBase = v1::LossHead::WithCallbackMethod_CreateHead<
    v1::LossHead::WithCallbackMethod_GetHead<v1::LossHead::WithCallbackMethod_ListHeads<
        v1::LossHead::WithCallbackMethod_DeleteHead<v1::LossHead::WithCallbackMethod_SetLossOptions<
            v1::LossHead::WithRawCallbackMethod_Step<v1::LossHead::WithRawCallbackMethod_PullGradient<
                v1::LossHead::WithCallbackMethod_PushWeights<
                    v1::LossHead::WithRawCallbackMethod_DownloadWeights<
                        v1::LossHead::WithCallbackMethod_SetOptimizer<
                            v1::LossHead::WithCallbackMethod_ApplyOptimizer<
                                v1::LossHead::WithCallbackMethod_GetStats<
                                    v1::LossHead::WithCallbackMethod_Checkpoint<
                                        v1::LossHead::WithCallbackMethod_GetClientProgress<
                                            v1::LossHead::WithRawCallbackMethod_EmbeddingRows<
                                                LossHeadSnapshotMethods>>>>>>>>>>>>>>>;

class LossHeadService final : public LossHeadServiceBase {
 public:
  explicit LossHeadService(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* CreateHead(grpc::CallbackServerContext* context,
                                       const v1::CreateHeadRequest* request,
                                       v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* GetHead(grpc::CallbackServerContext* context,
                                    const v1::GetHeadRequest* request,
                                    v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* ListHeads(grpc::CallbackServerContext* context,
                                      const v1::ListHeadsRequest* request,
                                      v1::ListHeadsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteHead(grpc::CallbackServerContext* context,
                                       const v1::DeleteHeadRequest* request,
                                       v1::DeleteHeadResponse* response) override;
  grpc::ServerUnaryReactor* SetLossOptions(grpc::CallbackServerContext* context,
                                           const v1::SetLossOptionsRequest* request,
                                           v1::HeadInfo* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Step(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullGradient(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request) override;
  grpc::ServerReadReactor<v1::PushWeightsRequest>* PushWeights(
      grpc::CallbackServerContext* context, v1::PushWeightsResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* DownloadWeights(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* EmbeddingRows(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::Stats* response) override;

  // The server-side optimizer (server/rpc/optimizer_service.cc).
  grpc::ServerUnaryReactor* SetOptimizer(grpc::CallbackServerContext* context,
                                         const v1::SetOptimizerRequest* request,
                                         v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* ApplyOptimizer(grpc::CallbackServerContext* context,
                                           const v1::ApplyOptimizerRequest* request,
                                           v1::ApplyOptimizerResponse* response) override;

  // Checkpoints (server/rpc/checkpoint_service.cc).
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const v1::CheckpointRequest* request,
                                       v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* GetClientProgress(grpc::CallbackServerContext* context,
                                              const v1::GetClientProgressRequest* request,
                                              v1::ClientProgress* response) override;

  // Named snapshots (server/rpc/snapshot_service.cc; a tagged Checkpoint writes one).
  grpc::ServerUnaryReactor* RestoreHead(grpc::CallbackServerContext* context,
                                        const v1::RestoreHeadRequest* request,
                                        v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* DeleteSnapshot(grpc::CallbackServerContext* context,
                                           const v1::DeleteSnapshotRequest* request,
                                           v1::DeleteSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* ListSnapshots(grpc::CallbackServerContext* context,
                                          const v1::ListSnapshotsRequest* request,
                                          v1::ListSnapshotsResponse* response) override;

  // Sets the per-head, device and host-buffer memory gauges, the heads' gradient window gauges
  // and the head count (run on every scrape).
  void RefreshMemoryMetrics() const;

 private:
  // On a server of a process group: `control` run on every process through the leader
  // (GroupControl::Run) on the worker pool, `answer` filling the response from this process's
  // result, and true; false (nothing done) on a server of one process.
  bool RunInGroup(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                  const char* method, absl::Time start, v1::ControlRequest control,
                  std::function<void(const v1::ControlResponse&)> answer);

  ServiceContext* const ctx_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_SERVICE_H_
