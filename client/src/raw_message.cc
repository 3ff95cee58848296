// Raw LossHead messages: see raw_message.h.
#include "raw_message.h"

#include <grpc/slice.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "losshead/v1/wire_format.h"

namespace losshead::client::raw {
namespace {

namespace wire = v1::wire;

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

void DataPieces::CopyTo(std::byte* out) const {
  for (const auto& [p, n] : pieces) {
    std::memcpy(out, p, n);
    out += n;
  }
}

namespace {

// Reads a serialized message held in gRPC slices without joining them.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return index_ == slices_.size(); }

  bool Byte(uint8_t* out) {
    if (done()) return false;
    *out = slices_[index_].begin()[pos_];
    Advance(1);
    return true;
  }
  bool Varint(uint64_t* out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      value |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) {
        *out = value;
        return true;
      }
    }
    return false;
  }
  // The next `n` bytes as pieces of the slices (no copy).
  bool Pieces(uint64_t n, std::vector<std::pair<const uint8_t*, size_t>>* out) {
    while (n > 0) {
      if (done()) return false;
      const size_t take = std::min<uint64_t>(n, slices_[index_].size() - pos_);
      out->emplace_back(slices_[index_].begin() + pos_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }
  // The next `n` bytes appended to `out`.
  bool Append(uint64_t n, std::string* out) {
    std::vector<std::pair<const uint8_t*, size_t>> pieces;
    if (!Pieces(n, &pieces)) return false;
    for (const auto& [p, size] : pieces) out->append(reinterpret_cast<const char*>(p), size);
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    if (pos_ == slices_[index_].size()) {
      ++index_;
      pos_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (index_ < slices_.size() && slices_[index_].size() == 0) ++index_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t pos_ = 0;
};

}  // namespace

// Parses `buffer` into `message`, except for the bytes field `data_field`, which is left in
// `data` as pieces of the buffer's slices (the last occurrence, as protobuf would keep).
absl::Status ParseWithoutData(grpc::ByteBuffer& buffer, uint32_t data_field,
                              google::protobuf::MessageLite* message, DataPieces* data) {
  data->slices.clear();
  data->pieces.clear();
  data->size = 0;
  if (!buffer.Dump(&data->slices).ok()) return absl::InternalError("unreadable message");
  SliceCursor in(data->slices);
  std::string rest;  // every other field, as it came
  while (!in.done()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return absl::InternalError("truncated message tag");
    const uint32_t wire_type = static_cast<uint32_t>(tag & 7);
    const uint64_t field = tag >> 3;
    bool ok = true;
    if (wire_type == wire::kLengthDelimited) {
      uint64_t n;
      ok = in.Varint(&n);
      if (ok && field == data_field) {
        data->pieces.clear();
        data->size = n;
        ok = in.Pieces(n, &data->pieces);
      } else if (ok) {
        wire::AppendVarint(rest, tag);
        wire::AppendVarint(rest, n);
        ok = in.Append(n, &rest);
      }
    } else if (wire_type == wire::kVarint) {
      uint64_t v;
      ok = in.Varint(&v);
      wire::AppendVarint(rest, tag);
      wire::AppendVarint(rest, v);
    } else if (wire_type == wire::kFixed64 || wire_type == wire::kFixed32) {
      wire::AppendVarint(rest, tag);
      ok = in.Append(wire_type == wire::kFixed64 ? 8 : 4, &rest);
    } else {
      return absl::InternalError(absl::StrCat("unexpected wire type ", wire_type, " in a chunk"));
    }
    if (!ok) return absl::InternalError("truncated chunk message");
  }
  if (!message->ParseFromString(rest)) return absl::InternalError("unparsable chunk message");
  return absl::OkStatus();
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
