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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "losshead/client/client.h"
#include "losshead/client/status.h"
#include "losshead/v1/wire_dtype.h"
#include "prefault.h"
#include "raw_message.h"
#include "transport/wire_format.h"

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
// The tensor is W (or dW), followed for a head with an output bias by b (or db). The bytes land
// in the caller's buffer, or in `owned` (allocated at Start) when it is not null; b goes to a
// destination of its own when one is given, else after W in the first one (the wire's layout).
class Reassembler {
 public:
  Reassembler(Destination weights, std::optional<Destination> bias)
      : out_(weights.data), owned_(weights.owned), bias_(bias) {}

  // `weight_bytes` of W and `bias_bytes` of b (0: the head has no bias) follow.
  absl::Status Start(uint64_t weight_bytes, uint64_t bias_bytes) {
    total_ = weight_bytes + bias_bytes;
    const bool split = bias_bytes > 0 && bias_.has_value();
    split_ = split ? weight_bytes : total_;
    if (split) {
      if (bias_->owned != nullptr) {
        bias_->owned->resize(bias_bytes);
        tail_ = std::span<std::byte>(*bias_->owned);
      } else if (bias_bytes > bias_->data.size()) {
        return absl::FailedPreconditionError(
            absl::StrCat("the head's output bias b takes ", bias_bytes,
                         " bytes; the bias buffer given holds ", bias_->data.size()));
      } else {
        tail_ = bias_->data;
      }
    }
    if (owned_ != nullptr) {
      owned_->resize(split_);
      out_ = std::span<std::byte>(*owned_);
    } else if (split_ > out_.size()) {
      if (bias_bytes > 0 && !split) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the head has an output bias: the server sends W (", weight_bytes,
            " bytes) followed by b (", bias_bytes, " bytes) and the buffer given holds ",
            out_.size(), "; give b a buffer of its own"));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "the server sends ", split_, " bytes; the buffer given holds ", out_.size()));
    } else {
      // The caller's buffer may be fresh memory (a new tensor): its pages are mapped in beside
      // the copies rather than one fault at a time by them.
      prefault_.Start(out_.data(), split_);
    }
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
    for (auto [p, size] : piece.pieces) {
      const uint8_t* from = p;
      // A piece may straddle the end of W and the start of b.
      while (size > 0) {
        const bool in_weights = filled_ < split_;
        std::byte* to = in_weights ? out_.data() + filled_ : tail_.data() + (filled_ - split_);
        const size_t n = std::min<uint64_t>(size, (in_weights ? split_ : total_) - filled_);
        std::memcpy(to, from, n);
        from += n;
        size -= n;
        filled_ += n;
      }
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
  std::optional<Destination> bias_;
  std::span<std::byte> tail_;  // where [split_, total_) goes when b has a destination of its own
  uint64_t total_ = 0;
  uint64_t split_ = 0;
  uint64_t filled_ = 0;
  Prefault prefault_;  // last: joined before the rest goes
};

// The bytes a first chunk announces: V x D (W or dW) and, with a bias, V (b or db), each of
// `dtype`; INTERNAL when total_bytes is not their sum.
absl::Status CheckTotal(const char* what, int64_t vocab_size, int64_t hidden_size, v1::DType dtype,
                        bool bias, uint64_t total_bytes, uint64_t* weight_bytes,
                        uint64_t* bias_bytes) {
  const uint64_t element = v1::WireDTypeSize(dtype);
  *weight_bytes = static_cast<uint64_t>(vocab_size) * static_cast<uint64_t>(hidden_size) * element;
  *bias_bytes = bias ? static_cast<uint64_t>(vocab_size) * element : 0;
  if (total_bytes != *weight_bytes + *bias_bytes) {
    return absl::InternalError(absl::StrCat(
        what, " total_bytes ", total_bytes,
        bias ? " != (V x D + V) x dtype = " : " != V x D x dtype = ", *weight_bytes + *bias_bytes));
  }
  return absl::OkStatus();
}

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
  // W, then b for a head with an output bias: one tensor on the wire, its offsets running on
  // from W's into b's. A piece may hold the end of W and the start of b.
  const std::span<const std::byte> parts[2] = {request.data, request.bias};
  const size_t total = request.data.size() + request.bias.size();
  size_t offset = 0;
  bool first = true;
  // An empty tensor still sends its header so that the server, not the client, rejects it.
  while (first || offset < total) {
    // Each message: its other fields and the data field's tag and length, encoded here, then
    // slices that reference the caller's bytes, which outlive the call (it ends before return).
    v1::PushWeightsRequest fields;
    if (first) *fields.mutable_header() = header;
    fields.set_offset(offset);
    std::string frame = fields.SerializeAsString();
    const size_t n = std::min(piece, total - offset);
    grpc::Slice slices[3];
    size_t count = 1;
    if (n > 0) {
      wire::AppendTag(frame, kPushDataField, wire::kLengthDelimited);
      wire::AppendVarint(frame, n);
      size_t at = offset;  // in the concatenation of the parts
      size_t base = 0;     // where the current part starts in it
      for (const std::span<const std::byte>& part : parts) {
        if (at < base + part.size() && at < offset + n) {
          const size_t take = std::min(base + part.size(), offset + n) - at;
          slices[count++] = grpc::Slice(reinterpret_cast<const char*>(part.data()) + (at - base),
                                        take, grpc::Slice::STATIC_SLICE);
          at += take;
        }
        base += part.size();
      }
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
                                                              v1::DType dtype, Destination out,
                                                              std::optional<Destination> bias) {
  v1::DownloadWeightsRequest request;
  request.set_head(head);
  request.set_dtype(dtype);
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel_.get(), raw::DownloadWeightsMethod(), context.get(), request));

  DownloadedWeights weights;
  Reassembler assembly(out, bias);
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
      weights.has_bias = chunk.bias();
      uint64_t weight_bytes = 0;
      uint64_t bias_bytes = 0;
      framing = CheckTotal("weights", chunk.vocab_size(), chunk.hidden_size(), chunk.dtype(),
                           chunk.bias(), chunk.total_bytes(), &weight_bytes, &bias_bytes);
      if (!framing.ok()) continue;
      framing = assembly.Start(weight_bytes, bias_bytes);
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
                                                             Destination out,
                                                             std::optional<Destination> bias) {
  v1::PullGradientRequest request;
  request.set_head(head);
  request.set_dtype(dtype);
  request.set_reset(reset);
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel_.get(), raw::PullGradientMethod(), context.get(), request));

  v1::GradientSummary summary;
  Reassembler assembly(out, bias);
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
      uint64_t weight_bytes = 0;
      uint64_t bias_bytes = 0;
      framing = CheckTotal("gradient", s.vocab_size(), s.hidden_size(), s.dtype(), s.bias(),
                           s.total_bytes(), &weight_bytes, &bias_bytes);
      if (!framing.ok()) continue;
      framing = assembly.Start(weight_bytes, bias_bytes);
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
