// Raw LossHead messages: see raw_message.h.
#include "raw_message.h"

#include <grpc/slice.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "transport/wire_format.h"

namespace losshead::client::raw {
namespace {

namespace wire = transport::wire;

// A LossHead method called without the typed stub (its messages are byte buffers).
class RawMethod {
 public:
  RawMethod(const char* method, grpc::internal::RpcMethod::RpcType type)
      : name_(absl::StrCat("/", v1::LossHead::service_full_name(), "/", method)),
        rpc_(name_.c_str(), type) {}
  const grpc::internal::RpcMethod& rpc() const { return rpc_; }

 private:
  const std::string name_;  // before rpc_, which keeps a pointer to it
  const grpc::internal::RpcMethod rpc_;
};

}  // namespace

const grpc::internal::RpcMethod& StepMethod() {
  static const RawMethod* method =
      new RawMethod("Step", grpc::internal::RpcMethod::BIDI_STREAMING);
  return method->rpc();
}

const grpc::internal::RpcMethod& PullGradientMethod() {
  static const RawMethod* method =
      new RawMethod("PullGradient", grpc::internal::RpcMethod::SERVER_STREAMING);
  return method->rpc();
}

const grpc::internal::RpcMethod& DownloadWeightsMethod() {
  static const RawMethod* method =
      new RawMethod("DownloadWeights", grpc::internal::RpcMethod::SERVER_STREAMING);
  return method->rpc();
}

const grpc::internal::RpcMethod& PushWeightsMethod() {
  static const RawMethod* method =
      new RawMethod("PushWeights", grpc::internal::RpcMethod::CLIENT_STREAMING);
  return method->rpc();
}

grpc::ByteBuffer MessageWithData(const std::string& fields, uint32_t data_field,
                                 std::span<const std::byte> data, const std::string& trailer) {
  std::string tag;
  if (!data.empty()) {
    wire::AppendTag(tag, data_field, wire::kLengthDelimited);
    wire::AppendVarint(tag, data.size());
  }
  const size_t total = fields.size() + tag.size() + data.size() + trailer.size();
  // One slice that gRPC owns: the caller's memory may be reused as soon as this returns.
  grpc_slice slice = grpc_slice_malloc(total);
  char* out = reinterpret_cast<char*>(GRPC_SLICE_START_PTR(slice));
  std::memcpy(out, fields.data(), fields.size());
  out += fields.size();
  std::memcpy(out, tag.data(), tag.size());
  out += tag.size();
  if (!data.empty()) std::memcpy(out, data.data(), data.size());
  out += data.size();
  std::memcpy(out, trailer.data(), trailer.size());
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

}  // namespace losshead::client::raw
