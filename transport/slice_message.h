// Received messages parsed without copying their one large bytes field: the client's pulls,
// downloads and Step answers, and the server's Step requests, read the tensor bytes straight out
// of gRPC's slices into their destination (a typed message would copy them into its bytes field
// first, and the destination copy would follow).
#ifndef LOSSHEAD_TRANSPORT_SLICE_MESSAGE_H_
#define LOSSHEAD_TRANSPORT_SLICE_MESSAGE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"

namespace losshead::transport::wire {

// Where one received message's bytes field lies: pieces of the message's slices, which stay
// alive as long as `slices` does.
struct DataPieces {
  std::vector<grpc::Slice> slices;
  std::vector<std::pair<const uint8_t*, size_t>> pieces;
  uint64_t size = 0;

  // Copies the pieces, in order, to `out` (which holds at least `size` bytes).
  void CopyTo(std::byte* out) const;
};

// Parses `buffer` into `message`, except for the bytes field `data_field`, which is left in
// `data` as pieces of the buffer's slices (the last occurrence, as protobuf would keep).
absl::Status ParseWithoutData(grpc::ByteBuffer& buffer, uint32_t data_field,
                              google::protobuf::MessageLite* message, DataPieces* data);

}  // namespace losshead::transport::wire

#endif  // LOSSHEAD_TRANSPORT_SLICE_MESSAGE_H_
