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
#include "transport/wire_format.h"
#include "prefault.h"
#include "raw_message.h"

namespace losshead::client {
namespace {

namespace wire = transport::wire;

// The `data` field of GradientChunk, WeightsChunk and PushWeightsRequest
// (proto/losshead/v1/losshead.proto).
constexpr uint32_t kGradientDataField = 3;
constexpr uint32_t kWeightsDataField = 7;
constexpr uint32_t kPushDataField = 3;

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
    } else {
      // The caller's buffer may be fresh memory (a new tensor): its pages are mapped in beside
      // the copies rather than one fault at a time by them.
      prefault_.Start(out_.data(), total_bytes);
    }
    total_ = total_bytes;
    return absl::OkStatus();
  }
  absl::Status Add(uint64_t offset, const raw::DataPieces& piece) {
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
  Prefault prefault_;  // last: joined before the rest goes
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
          channel_.get(), raw::PushWeightsMethod(), context.get(), &response));

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
          channel_.get(), raw::DownloadWeightsMethod(), context.get(), request));

  DownloadedWeights weights;
  Reassembler assembly(out, owned);
  absl::Status framing;
  grpc::ByteBuffer buffer;
  v1::WeightsChunk chunk;
  raw::DataPieces data;
  bool first = true;
  while (reader->Read(&buffer)) {
    if (!framing.ok()) continue;  // drain so that Finish() can return
    chunk.Clear();
    framing = raw::ParseWithoutData(buffer, kWeightsDataField, &chunk, &data);
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
          channel_.get(), raw::PullGradientMethod(), context.get(), request));

  v1::GradientSummary summary;
  Reassembler assembly(out, owned);
  absl::Status framing;
  grpc::ByteBuffer buffer;
  v1::GradientChunk chunk;
  raw::DataPieces data;
  bool first = true;
  while (reader->Read(&buffer)) {
    if (!framing.ok()) continue;  // drain so that Finish() can return
    chunk.Clear();
    framing = raw::ParseWithoutData(buffer, kGradientDataField, &chunk, &data);
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
