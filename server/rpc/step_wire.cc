#include "server/rpc/step_wire.h"

#include <cstdint>
#include <string>
#include <utility>

#include "grpcpp/support/slice.h"
#include "transport/wire_format.h"
#include "server/rpc/shared_slice.h"
#include "server/rpc/step_assembler.h"

namespace losshead::server {
namespace {

namespace wire = transport::wire;

// StepResponse's end-of-answer field (proto/losshead/v1/losshead.proto).
constexpr uint32_t kLastField = 7;

grpc::ByteBuffer Serialized(const v1::StepResponse& response) {
  grpc::Slice slice(response.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

std::vector<grpc::ByteBuffer> EncodeStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes, bool grad_hidden_shared) {
  std::vector<grpc::ByteBuffer> out;
  out.push_back(Serialized(FirstStepResponse(header, outcome, replayed, grad_hidden_shared)));
  if (!outcome.ok()) return out;
  const std::shared_ptr<const StepOutcome>& o = *outcome;
  const std::vector<StepPayload> payloads = StepPayloads(*o, grad_hidden_shared);
  const std::vector<std::vector<StepSpan>> pieces = PlanStepPieces(payloads, chunk_bytes);
  if (pieces.empty()) return out;
  // Every piece starts with the ids, encoded once (fields in number order, as protobuf writes).
  v1::StepResponse ids;
  ids.set_client_id(header.client_id());
  ids.set_sequence(header.sequence());
  const std::string ids_bytes = ids.SerializeAsString();
  out.reserve(1 + pieces.size());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < pieces.size(); ++i) {
    slices.clear();
    std::string frame = ids_bytes;
    for (const StepSpan& span : pieces[i]) {
      const StepPayload& payload = payloads[span.tensor];
      wire::AppendTag(frame, payload.field, wire::kLengthDelimited);
      wire::AppendVarint(frame, span.bytes);
      slices.emplace_back(frame);
      slices.push_back(SharedSlice(o, payload.bytes.data() + span.offset, span.bytes));
      frame.clear();
    }
    if (i + 1 == pieces.size()) {
      wire::AppendTag(frame, kLastField, wire::kVarint);
      wire::AppendVarint(frame, 1);
    }
    if (!frame.empty()) slices.emplace_back(frame);
    out.emplace_back(slices.data(), slices.size());
  }
  return out;
}

}  // namespace losshead::server
