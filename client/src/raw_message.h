// LossHead methods spoken with gRPC byte buffers instead of typed messages, so that tensor bytes
// are copied once between the caller's memory and gRPC's slices (a typed message costs two copies
// of every byte on each side: into its bytes field, then into the slices, when sending; out of the
// slices into the field, then into the destination, when receiving).
#ifndef LOSSHEAD_CLIENT_SRC_RAW_MESSAGE_H_
#define LOSSHEAD_CLIENT_SRC_RAW_MESSAGE_H_

#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "transport/slice_message.h"

namespace losshead::client::raw {

// The LossHead methods this client calls without the typed stub.
const grpc::internal::RpcMethod& StepMethod();
const grpc::internal::RpcMethod& PullGradientMethod();
const grpc::internal::RpcMethod& DownloadWeightsMethod();
const grpc::internal::RpcMethod& PushWeightsMethod();

// Received messages whose bytes field is read from gRPC's slices in place (wire::ParseWithoutData).
using transport::wire::DataPieces;
using transport::wire::ParseWithoutData;

// One message: `fields` (a serialized message without the bytes field), then the bytes field
// `data_field` holding a copy of `data` (left out when empty), then `trailer` (more serialized
// fields). Field order does not matter to protobuf; the copy of `data` is the only one made.
grpc::ByteBuffer MessageWithData(const std::string& fields, uint32_t data_field,
                                 std::span<const std::byte> data, const std::string& trailer);

}  // namespace losshead::client::raw

#endif  // LOSSHEAD_CLIENT_SRC_RAW_MESSAGE_H_
