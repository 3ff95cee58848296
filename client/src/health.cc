// grpc.health.v1.Health/Check through the generic stub. Debian's gRPC ships no generated health
// messages, and generating our own copy could collide with a server's copy linked into the same
// process, so the two tiny messages are encoded by hand.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <future>
#include <string>
#include <vector>

#include "losshead/client/client.h"
#include "losshead/client/status.h"

namespace losshead::client {
namespace {

void PutVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

bool GetVarint(const std::string& in, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(in[(*pos)++]);
    *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// HealthCheckRequest { string service = 1; }
std::string EncodeRequest(const std::string& service) {
  std::string out;
  if (!service.empty()) {
    out.push_back(0x0a);  // field 1, length-delimited
    PutVarint(service.size(), &out);
    out += service;
  }
  return out;
}

// HealthCheckResponse { ServingStatus status = 1; }; unknown fields are skipped.
absl::StatusOr<ServingStatus> DecodeResponse(const std::string& in) {
  uint64_t status = 0;
  size_t pos = 0;
  while (pos < in.size()) {
    uint64_t key;
    if (!GetVarint(in, &pos, &key)) return absl::InternalError("bad health response");
    const uint64_t wire_type = key & 7;
    uint64_t value;
    if (wire_type == 0) {
      if (!GetVarint(in, &pos, &value)) return absl::InternalError("bad health response");
      if ((key >> 3) == 1) status = value;
    } else if (wire_type == 2) {
      if (!GetVarint(in, &pos, &value) || value > in.size() - pos) {
        return absl::InternalError("bad health response");
      }
      pos += value;
    } else if (wire_type == 1 || wire_type == 5) {
      pos += wire_type == 1 ? 8 : 4;
    } else {
      return absl::InternalError("bad health response");
    }
  }
  if (status > 3) return ServingStatus::kUnknown;
  return static_cast<ServingStatus>(status);
}

}  // namespace

absl::StatusOr<ServingStatus> Client::Health(const std::string& service) {
  return HealthCheck(service, options_.deadline, /*wait_for_ready=*/false);
}

absl::StatusOr<ServingStatus> Client::HealthCheck(const std::string& service,
                                                  absl::Duration deadline, bool wait_for_ready) {
  const std::string encoded = EncodeRequest(service);
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  auto context = NewContext(deadline);
  context->set_wait_for_ready(wait_for_ready);
  grpc::GenericStub stub(channel_);
  std::promise<grpc::Status> done;
  stub.UnaryCall(context.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&done](grpc::Status status) { done.set_value(std::move(status)); });
  grpc::Status status = done.get_future().get();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable health response");
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return DecodeResponse(bytes);
}

}  // namespace losshead::client
