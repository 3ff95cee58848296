// libFuzzer target: random bytes as a sequence of StepRequest messages (see step_fuzz_format.h)
// through what the server does with a Step stream short of gRPC's transport: the parse that leaves
// the hidden states in the message's slices (wire::ParseWithoutData, the bytes cut into two slices
// at a point the input picks; it must accept nothing protobuf refuses and agree with protobuf on
// what it accepts), admission bookkeeping from the header (AnnouncedBytes), reassembly
// (StepAssembler, with the skipping of an oversize
// micro-batch's rest and the digests of its key's fingerprint), validation and the step itself on
// a tiny CPU head (Head::Step: dtype, shape, target and option checks, idempotent replay, refusal
// of a key reused for other content), and the response chunking (BuildStepResponses). It must
// never crash, hang or grow without bound; the checks below abort on broken invariants so that
// the fuzzer reports them.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "losshead/kernels/backend.h"
#include "losshead/v1/losshead.pb.h"
#include "transport/slice_message.h"
#include "server/engine/admission.h"
#include "server/engine/head.h"
#include "server/engine/request_fingerprint.h"
#include "server/rpc/step_assembler.h"

namespace {

using losshead::server::AssembledMicroBatch;
using losshead::server::Head;
using losshead::server::StepAssembler;

// Small limits keep each input cheap: a micro-batch beyond 64 KiB is refused as oversize.
constexpr size_t kMaxMicrobatchBytes = 64 << 10;
constexpr size_t kChunkBytes = 256;
constexpr uint32_t kHiddenField = 2;  // StepRequest.hidden

losshead::kernels::Backend& Backend() {
  static auto* backend =
      losshead::kernels::CreateBackend(losshead::kernels::BackendKind::kCpu)->release();
  return *backend;
}

}  // namespace

// Aborts with the broken invariant named, so that a crash report says which one failed.
#define FUZZ_CHECK(condition)                                                                \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (false)

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Invalid UTF-8 in string fields is a parse failure the target expects; do not log each one.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A fresh head per input: state (counters, idempotency cache) never carries over.
  losshead::v1::HeadSpec spec;
  spec.set_name("fuzz");
  spec.set_vocab_size(7);
  spec.set_hidden_size(4);
  spec.set_weight_dtype(losshead::v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  auto head =
      Head::Create(Backend(), spec,
                   losshead::server::HeadOptions{.workspace_budget_bytes = 1 << 20,
                                                 .idempotency_window = 4,
                                                 .idempotency_max_bytes_per_client = 1 << 16});
  FUZZ_CHECK(head.ok());
  auto assembler = std::make_unique<StepAssembler>(kMaxMicrobatchBytes);
  size_t pos = 0;
  int microbatches = 0;
  while (pos + 2 <= size && microbatches < 64) {
    const size_t n = data[pos] | (size_t{data[pos + 1]} << 8);
    pos += 2;
    const size_t len = n < size - pos ? n : size - pos;
    // The message as gRPC hands it over: in slices, here two, cut where its first byte says.
    const char* bytes = reinterpret_cast<const char*>(data + pos);
    const size_t cut = len == 0 ? 0 : data[pos] % (len + 1);
    grpc::Slice slices[2] = {grpc::Slice(bytes, cut), grpc::Slice(bytes + cut, len - cut)};
    grpc::ByteBuffer buffer(slices, 2);
    losshead::server::StepMessage message;
    losshead::transport::wire::DataPieces hidden;
    const bool parsed =
        losshead::transport::wire::ParseWithoutData(buffer, kHiddenField, &message.request, &hidden).ok();
    losshead::v1::StepRequest typed;
    const bool typed_parsed = typed.ParseFromArray(bytes, static_cast<int>(len));
    pos += len;
    if (!parsed) {
      assembler = std::make_unique<StepAssembler>(kMaxMicrobatchBytes);  // a new stream
      continue;
    }
    // Accepted: protobuf accepts it too, with the same fields and the same hidden bytes.
    FUZZ_CHECK(typed_parsed);
    std::string joined(hidden.size, '\0');
    hidden.CopyTo(reinterpret_cast<std::byte*>(joined.data()));
    FUZZ_CHECK(joined == typed.hidden());
    typed.clear_hidden();
    FUZZ_CHECK(typed.SerializeAsString() == message.request.SerializeAsString());
    message.hidden = hidden.pieces;
    message.hidden_bytes = hidden.size;
    const losshead::v1::StepRequest& request = message.request;
    if (request.has_header()) {
      const uint64_t announced =
          losshead::server::AnnouncedBytes(request.header(), (*head)->hidden_size());
      // Announced bytes are exactly what a valid micro-batch carries: N x (D x h + t).
      FUZZ_CHECK(announced == 0 ||
                 announced >= static_cast<uint64_t>(request.header().num_tokens()));
    }
    auto added = assembler->Add(message, absl::Now());
    if (!added.ok()) {
      FUZZ_CHECK(added.status().code() == absl::StatusCode::kInvalidArgument);
      assembler = std::make_unique<StepAssembler>(kMaxMicrobatchBytes);
      continue;
    }
    if (!added->has_value()) continue;
    ++microbatches;
    AssembledMicroBatch& mb = **added;
    // Every byte received is in the micro-batch: hidden states, targets and per-token inputs.
    size_t kept = mb.microbatch.hidden.size() + mb.microbatch.targets.size();
    for (const std::string& input : mb.microbatch.token_inputs) kept += input.size();
    FUZZ_CHECK(mb.oversize || kept == mb.received_bytes);
    FUZZ_CHECK(mb.oversize == (mb.received_bytes > kMaxMicrobatchBytes));
    // Digests taken piece by piece are those of the whole tensors (the key's fingerprint).
    FUZZ_CHECK(mb.microbatch.hidden_digest.has_value() == mb.microbatch.targets_digest.has_value());
    if (mb.microbatch.hidden_digest.has_value()) {
      FUZZ_CHECK(*mb.microbatch.hidden_digest ==
                 losshead::server::ByteDigest::Of(mb.microbatch.hidden));
      FUZZ_CHECK(*mb.microbatch.targets_digest ==
                 losshead::server::ByteDigest::Of(mb.microbatch.targets));
    }
    absl::StatusOr<std::shared_ptr<const losshead::server::StepOutcome>> outcome =
        absl::ResourceExhaustedError("oversize");
    losshead::server::StepStats stats;
    const losshead::v1::HeadInfo before = (*head)->Info();
    if (!mb.oversize) outcome = (*head)->Step(mb.microbatch, &stats);
    const losshead::v1::HeadInfo after = (*head)->Info();
    const bool forward_only = mb.microbatch.header.options().forward_only();
    if (outcome.ok()) FUZZ_CHECK((*outcome)->forward_only == forward_only);
    if (!outcome.ok() || stats.replayed || forward_only) {
      // Bad input changes nothing; a replay adds nothing; a forward-only step counts nothing.
      FUZZ_CHECK(after.microbatches_total() == before.microbatches_total());
      FUZZ_CHECK(after.tokens_total() == before.tokens_total());
    } else {
      FUZZ_CHECK(after.microbatches_total() == before.microbatches_total() + 1);
      FUZZ_CHECK(static_cast<int64_t>(after.tokens_total() - before.tokens_total()) ==
                 (*outcome)->token_count);
    }
    const auto responses = losshead::server::BuildStepResponses(mb.microbatch.header, outcome,
                                                                stats.replayed, kChunkBytes);
    FUZZ_CHECK(!responses.empty() && responses.back().last());
    for (size_t i = 0; i + 1 < responses.size(); ++i) FUZZ_CHECK(!responses[i].last());
    for (const auto& r : responses) {
      FUZZ_CHECK(r.grad_hidden().size() + r.per_token_loss().size() <= kChunkBytes);
    }
  }
  return 0;
}
