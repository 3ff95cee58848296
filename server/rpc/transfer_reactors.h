// The streaming RPCs that move whole tensors: PullGradient and DownloadWeights (server-streamed,
// chunked below the message limit, registered raw so that their messages reference the snapshot
// instead of copying it) and PushWeights (client-streamed, staged on the host and applied only
// when complete). Device copies run on the worker pool, never in a reaction.
#ifndef LOSSHEAD_SERVER_RPC_TRANSFER_REACTORS_H_
#define LOSSHEAD_SERVER_RPC_TRANSFER_REACTORS_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/rpc/service_context.h"

namespace losshead::server {

// Each returns a self-deleting reactor for the call.
// A pull with reset fails with `reset_permission` (when not OK) before anything is read or reset.
// `request` is the serialised PullGradientRequest / DownloadWeightsRequest (INVALID_ARGUMENT when
// it does not parse); the responses are serialised GradientChunk / WeightsChunk messages.
// On a server of a process group the pull is a cut of every process's window, run through the
// leader with the caller's `authorization` forwarded (group_control.h).
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartPullGradient(
    ServiceContext* ctx, const grpc::ByteBuffer* request,
    absl::Status reset_permission = absl::OkStatus(), std::string authorization = "");
// The rows of W for token ids (EmbeddingRowsRequest), streamed like DownloadWeights; of a head
// sharded across processes, through the leader (every process sends the rows it owns), with the
// caller's `authorization` forwarded.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartEmbeddingRows(ServiceContext* ctx,
                                                               const grpc::ByteBuffer* request,
                                                               std::string authorization = "");
// A head sharded across processes is downloaded through the leader (every process sends its
// rows), with the caller's `authorization` forwarded.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartDownloadWeights(ServiceContext* ctx,
                                                                 const grpc::ByteBuffer* request,
                                                                 std::string authorization = "");
// On a server of a process group the push reaches every process through the leader, with the
// caller's `authorization` forwarded (group_control.h).
grpc::ServerReadReactor<v1::PushWeightsRequest>* StartPushWeights(
    ServiceContext* ctx, v1::PushWeightsResponse* response, std::string authorization = "");

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_TRANSFER_REACTORS_H_
