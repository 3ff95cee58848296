#include "server/rpc/step_wire.h"

#include <cstdint>
#include <string>
#include <utility>

#include "grpcpp/support/slice.h"
#include "server/rpc/step_assembler.h"

namespace losshead::server {
namespace {

// StepResponse's payload and end-of-answer fields (proto/losshead/v1/losshead.proto).
constexpr uint32_t kGradHiddenField = 5;
constexpr uint32_t kPerTokenLossField = 6;
constexpr uint32_t kLastField = 7;
constexpr uint32_t kWireVarint = 0;
constexpr uint32_t kWireLengthDelimited = 2;

void AppendVarint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void AppendTag(std::string& out, uint32_t field, uint32_t wire_type) {
  AppendVarint(out, (uint64_t{field} << 3) | wire_type);
}

void ReleaseOutcome(void* holder) {
  delete static_cast<std::shared_ptr<const StepOutcome>*>(holder);
}

// `bytes` bytes at `data`, inside `outcome`'s buffers, without a copy: the slice holds a
// reference to the outcome until gRPC has written it.
grpc::Slice Reference(const std::shared_ptr<const StepOutcome>& outcome, const char* data,
                      size_t bytes) {
  // gRPC only reads the slice; its constructor merely takes a mutable pointer.
  return grpc::Slice(const_cast<char*>(data), bytes, &ReleaseOutcome,
                     new std::shared_ptr<const StepOutcome>(outcome));
}

grpc::ByteBuffer Serialized(const v1::StepResponse& response) {
  grpc::Slice slice(response.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

std::vector<grpc::ByteBuffer> EncodeStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes) {
  std::vector<grpc::ByteBuffer> out;
  out.push_back(Serialized(FirstStepResponse(header, outcome, replayed)));
  if (!outcome.ok()) return out;
  const std::shared_ptr<const StepOutcome>& o = *outcome;
  const std::vector<StepPiece> pieces =
      PlanStepPieces(o->grad_hidden.size(), o->per_token_loss.size(), chunk_bytes);
  if (pieces.empty()) return out;
  // Every piece starts with the ids, encoded once (fields in number order, as protobuf writes).
  v1::StepResponse ids;
  ids.set_client_id(header.client_id());
  ids.set_sequence(header.sequence());
  const std::string ids_bytes = ids.SerializeAsString();
  out.reserve(1 + pieces.size());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const StepPiece& piece = pieces[i];
    slices.clear();
    std::string frame = ids_bytes;
    if (piece.grad_bytes > 0) {
      AppendTag(frame, kGradHiddenField, kWireLengthDelimited);
      AppendVarint(frame, piece.grad_bytes);
      slices.emplace_back(frame);
      slices.push_back(Reference(o, o->grad_hidden.data() + piece.grad_offset, piece.grad_bytes));
      frame.clear();
    }
    if (piece.loss_bytes > 0) {
      AppendTag(frame, kPerTokenLossField, kWireLengthDelimited);
      AppendVarint(frame, piece.loss_bytes);
      slices.emplace_back(frame);
      slices.push_back(
          Reference(o, o->per_token_loss.data() + piece.loss_offset, piece.loss_bytes));
      frame.clear();
    }
    if (i + 1 == pieces.size()) {
      AppendTag(frame, kLastField, kWireVarint);
      AppendVarint(frame, 1);
    }
    if (!frame.empty()) slices.emplace_back(frame);
    out.emplace_back(slices.data(), slices.size());
  }
  return out;
}

}  // namespace losshead::server
