// Chunked tensor transfers: weights up (push), weights down (download), gradients down (pull).
//
// The tensor bytes never pass through a protobuf message here. A typed message costs two copies
// of every byte on each side (into its bytes field, then into gRPC's slices, when sending; out of
// the slices into the field, then into the destination, when receiving), and for a 2 GB gradient
// those copies were most of the time of a pull. These calls speak the same methods with gRPC
// byte buffers instead: a push references the caller's memory from the slices it writes, and a
// received chunk is walked slice by slice, its `data` field copied once, straight to its place in
// the destination; every other field is parsed by protobuf as before.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/sync_stream.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "losshead/client/client.h"
#include "losshead/client/status.h"
#include "losshead/v1/wire_dtype.h"
#include "losshead/v1/wire_format.h"

namespace losshead::client {
namespace {

namespace wire = v1::wire;

// The `data` field of GradientChunk, WeightsChunk and PushWeightsRequest
// (proto/losshead/v1/losshead.proto).
constexpr uint32_t kGradientDataField = 3;
constexpr uint32_t kWeightsDataField = 7;
constexpr uint32_t kPushDataField = 3;

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

// Where one received message's `data` field lies: pieces of the message's slices, which stay
// alive as long as `slices` does.
struct DataPieces {
  std::vector<grpc::Slice> slices;
  std::vector<std::pair<const uint8_t*, size_t>> pieces;
  uint64_t size = 0;
};

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

// Collects chunks that must tile [0, total) in order, without gaps or overlap; the server
// promises this order, so anything else is a framing error rather than something to reorder.
// The bytes land in the caller's buffer, or in `owned` (allocated at Start) when it is not null.
class Reassembler {
 public:
  Reassembler(std::span<std::byte> out, Bytes* owned) : out_(out), owned_(owned) {}

  absl::Status Start(uint64_t total_bytes, uint64_t max_bytes) {
    if (total_bytes > max_bytes) {
      return absl::InternalError(
          absl::StrCat("server announced ", total_bytes, " bytes, expected ", max_bytes));
    }
    if (owned_ != nullptr) {
      owned_->resize(total_bytes);
      out_ = std::span<std::byte>(*owned_);
    } else if (total_bytes > out_.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the server sends ", total_bytes, " bytes; the buffer given holds ", out_.size()));
    }
    total_ = total_bytes;
    return absl::OkStatus();
  }
  absl::Status Add(uint64_t offset, const DataPieces& piece) {
    if (offset != filled_) {
      return absl::InternalError(
          absl::StrCat("chunk at offset ", offset, " while ", filled_, " bytes are filled"));
    }
    if (piece.size > total_ - filled_) {
      return absl::InternalError(absl::StrCat("chunk of ", piece.size, " bytes at offset ", offset,
                                              " overruns the total of ", total_));
    }
    for (const auto& [p, size] : piece.pieces) {
      std::memcpy(out_.data() + filled_, p, size);
      filled_ += size;
    }
    return absl::OkStatus();
  }
  absl::Status Finish() const {
    if (filled_ != total_) {
      return absl::InternalError(
          absl::StrCat("stream ended after ", filled_, " of ", total_, " bytes"));
    }
    return absl::OkStatus();
  }

 private:
  std::span<std::byte> out_;
  Bytes* owned_;
  uint64_t total_ = 0;
  uint64_t filled_ = 0;
};

}  // namespace

absl::StatusOr<uint64_t> Client::PushWeightsOnce(const PushRequest& request) {
  v1::PushHeader header;
  header.set_head(request.head);
  header.set_dtype(request.dtype);
  header.set_mode(request.mode);
  if (request.expected_weights_version.has_value()) {
    header.set_expected_weights_version(*request.expected_weights_version);
  }
  auto context = NewContext(options_.deadline);
  v1::PushWeightsResponse response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel_.get(), PushWeightsMethod(), context.get(), &response));

  const size_t piece = PieceBytes(options_.max_message_bytes, header.ByteSizeLong() + 16);
  const char* data = reinterpret_cast<const char*>(request.data.data());
  size_t offset = 0;
  bool first = true;
  // An empty tensor still sends its header so that the server, not the client, rejects it.
  while (first || offset < request.data.size()) {
    // Each message: its other fields and the data field's tag and length, encoded here, then a
    // slice that references the caller's bytes, which outlive the call (it ends before return).
    v1::PushWeightsRequest fields;
    if (first) *fields.mutable_header() = header;
    fields.set_offset(offset);
    std::string frame = fields.SerializeAsString();
    const size_t n = std::min(piece, request.data.size() - offset);
    grpc::Slice slices[2];
    size_t count = 1;
    if (n > 0) {
      wire::AppendTag(frame, kPushDataField, wire::kLengthDelimited);
      wire::AppendVarint(frame, n);
      slices[1] = grpc::Slice(data + offset, n, grpc::Slice::STATIC_SLICE);
      count = 2;
    }
    slices[0] = grpc::Slice(frame);
    grpc::ByteBuffer message(slices, count);
    offset += n;
    first = false;
    // A failed write means the server ended the call; Finish() says why.
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return response.weights_version();
}

absl::StatusOr<uint64_t> Client::UploadWeights(const std::string& head, v1::DType dtype,
                                               std::span<const std::byte> data) {
  PushRequest request;
  request.head = head;
  request.dtype = dtype;
  request.data = data;
  return PushWeights(request);
}

absl::StatusOr<DownloadedWeights> Client::DownloadWeightsOnce(const std::string& head,
                                                              v1::DType dtype,
                                                              std::span<std::byte> out,
                                                              Bytes* owned) {
  v1::DownloadWeightsRequest request;
  request.set_head(head);
  request.set_dtype(dtype);
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel_.get(), DownloadWeightsMethod(), context.get(), request));

  DownloadedWeights weights;
  Reassembler assembly(out, owned);
  absl::Status framing;
  grpc::ByteBuffer buffer;
  v1::WeightsChunk chunk;
  DataPieces data;
  bool first = true;
  while (reader->Read(&buffer)) {
    if (!framing.ok()) continue;  // drain so that Finish() can return
    chunk.Clear();
    framing = ParseWithoutData(buffer, kWeightsDataField, &chunk, &data);
    if (!framing.ok()) continue;
    if (first) {
      first = false;
      weights.vocab_size = chunk.vocab_size();
      weights.hidden_size = chunk.hidden_size();
      weights.dtype = chunk.dtype();
      weights.weights_version = chunk.weights_version();
      const uint64_t expected = static_cast<uint64_t>(chunk.vocab_size()) *
                                static_cast<uint64_t>(chunk.hidden_size()) *
                                v1::WireDTypeSize(chunk.dtype());
      if (chunk.total_bytes() != expected) {
        framing = absl::InternalError(absl::StrCat("weights total_bytes ", chunk.total_bytes(),
                                                   " != V x D x dtype = ", expected));
        continue;
      }
      framing = assembly.Start(chunk.total_bytes(), expected);
      if (!framing.ok()) continue;
    }
    framing = assembly.Add(chunk.offset(), data);
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!framing.ok()) return framing;
  if (first) return absl::InternalError("download ended without a first chunk");
  if (absl::Status done = assembly.Finish(); !done.ok()) return done;
  return weights;
}

absl::StatusOr<v1::GradientSummary> Client::PullGradientOnce(const std::string& head,
                                                             v1::DType dtype, bool reset,
                                                             std::span<std::byte> out,
                                                             Bytes* owned) {
  v1::PullGradientRequest request;
  request.set_head(head);
  request.set_dtype(dtype);
  request.set_reset(reset);
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel_.get(), PullGradientMethod(), context.get(), request));

  v1::GradientSummary summary;
  Reassembler assembly(out, owned);
  absl::Status framing;
  grpc::ByteBuffer buffer;
  v1::GradientChunk chunk;
  DataPieces data;
  bool first = true;
  while (reader->Read(&buffer)) {
    if (!framing.ok()) continue;  // drain so that Finish() can return
    chunk.Clear();
    framing = ParseWithoutData(buffer, kGradientDataField, &chunk, &data);
    if (!framing.ok()) continue;
    if (first) {
      first = false;
      if (!chunk.has_summary()) {
        framing = absl::InternalError("first gradient chunk carries no summary");
        continue;
      }
      summary = chunk.summary();
      const v1::GradientSummary& s = summary;
      const uint64_t expected = static_cast<uint64_t>(s.vocab_size()) *
                                static_cast<uint64_t>(s.hidden_size()) *
                                v1::WireDTypeSize(s.dtype());
      if (s.total_bytes() != expected) {
        framing = absl::InternalError(absl::StrCat("gradient total_bytes ", s.total_bytes(),
                                                   " != V x D x dtype = ", expected));
        continue;
      }
      framing = assembly.Start(s.total_bytes(), expected);
      if (!framing.ok()) continue;
    } else if (chunk.has_summary()) {
      framing = absl::InternalError("summary repeated after the first gradient chunk");
      continue;
    }
    framing = assembly.Add(chunk.offset(), data);
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!framing.ok()) return framing;
  if (first) return absl::InternalError("pull ended without a summary");
  if (absl::Status done = assembly.Finish(); !done.ok()) return done;
  return summary;
}

}  // namespace losshead::client
