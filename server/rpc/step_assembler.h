// Step stream framing, free of gRPC: assembling requests into micro-batches, and cutting one
// micro-batch's outcome into response messages.
#ifndef LOSSHEAD_SERVER_RPC_STEP_ASSEMBLER_H_
#define LOSSHEAD_SERVER_RPC_STEP_ASSEMBLER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/head.h"
#include "server/engine/pinned_pool.h"
#include "server/engine/request_fingerprint.h"
#include "server/engine/step_outcome.h"

namespace losshead::server {

// One received StepRequest: its fields, and its hidden states as pieces of memory the caller keeps
// alive while the assembler runs (the gRPC slices they arrived in), so that they are copied once,
// into the micro-batch's buffer, rather than into the message first. `request.hidden()` is empty.
struct StepMessage {
  v1::StepRequest request;
  std::vector<std::pair<const uint8_t*, size_t>> hidden;
  size_t hidden_bytes = 0;
  // The pieces lie in a client's shared memory region (docs/same-node.md): the whole micro-batch
  // is in this one message.
  bool shared = false;
  // Bytes of hidden states and targets that lie in a client's device region (docs/same-node.md,
  // "The device path"): counted as received (for the size limits), copied out by the server
  // when the micro-batch runs (region_input.h). The message carries no pieces then.
  size_t region_bytes = 0;

  size_t bytes() const {
    return hidden_bytes + region_bytes + request.targets().size() + request.token_weights().size() +
           request.old_logprob().size() + request.advantages().size() +
           request.ref_logprob().size();
  }
  void Clear() {
    request.Clear();
    hidden.clear();
    hidden_bytes = 0;
    shared = false;
    region_bytes = 0;
  }
};

// A micro-batch as assembled from the stream. `oversize` means its bytes passed the limit and
// were dropped: it must be answered RESOURCE_EXHAUSTED.
struct AssembledMicroBatch {
  MicroBatch microbatch;
  bool oversize = false;
  // Not OK when the server refused the micro-batch (admission, or a header it can never serve):
  // its bytes were dropped like an oversize one's and it must be answered with this status.
  absl::Status refused;
  uint64_t received_bytes = 0;  // hidden + targets + token inputs bytes, dropped ones included
  absl::Time first_message;
  absl::Time last_message;
};

// Assembles the messages of a Step stream into micro-batches. The hidden states are copied out of
// the messages once, in cache-sized steps; while each step is still in cache it is checked for
// NaN and Inf in the header's dtype and its largest magnitude taken (MicroBatch::hidden_max_abs,
// which also bounds what the micro-batch computes) and, for a micro-batch whose
// key may be remembered (a client id, not forward-only), digested with the targets
// (MicroBatch::hidden_digest, targets_digest: its idempotency fingerprint), so that no second
// pass over a large micro-batch is needed before its run. A micro-batch of several messages is
// assembled in page-locked memory from a PinnedPool where there is one (ReserveHidden).
//
// A micro-batch refused before its last message (Refuse, or oversize) is handed back at once to
// be answered; the rest of its messages are skipped: they may follow as usual, or the client may
// leave them out and send the next header (or end the stream) right away.
class StepAssembler {
 public:
  explicit StepAssembler(size_t max_microbatch_bytes, std::shared_ptr<PinnedPool> pinned = nullptr)
      : max_bytes_(max_microbatch_bytes), pinned_(std::move(pinned)) {}

  // Feeds the next request. INVALID_ARGUMENT for a malformed stream (data outside a micro-batch,
  // a header inside one); the caller must end the call. Returns the micro-batch when `last`
  // closes it, or when its bytes pass the limit (oversize; the rest of it is then skipped), and
  // std::nullopt while it is still open or its message was skipped.
  // `reserve_bytes`, when the message opens a micro-batch that goes on past it (or one from
  // shared memory): the size its hidden buffer is given before anything is stored (ReserveHidden).
  absl::StatusOr<std::optional<AssembledMicroBatch>> Add(StepMessage& message, absl::Time now,
                                                         size_t reserve_bytes = 0);
  // The same for a request that carries its hidden states in its own field.
  absl::StatusOr<std::optional<AssembledMicroBatch>> Add(v1::StepRequest& request, absl::Time now);

  // True inside a micro-batch (a stream may not end here). A skipped one's rest is not.
  bool open() const { return current_.has_value(); }
  // The open micro-batch's header (requires open()).
  const v1::StepHeader& open_header() const { return current_->microbatch.header; }
  // True while the open micro-batch keeps what it receives (neither oversize nor refused).
  bool buffering() const {
    return current_.has_value() && !current_->oversize && current_->refused.ok();
  }
  // True while the rest of a micro-batch handed back early is being skipped.
  bool skipping() const { return skipping_; }

  // Sizes the open micro-batch's hidden buffer for `bytes` (capped by the micro-batch limit) when
  // it is still buffering: its pieces then append without the reallocations, and the copies of
  // everything received so far, that growing by doubling costs. With a PinnedPool the buffer is
  // page-locked (ordinary memory when the pool has none to give).
  void ReserveHidden(size_t bytes);
  // Refuses the open micro-batch (requires open()): frees its bytes and hands it back, to be
  // answered with `status` (not OK) now; the rest of its messages are skipped.
  AssembledMicroBatch Refuse(absl::Status status);
  // Forgets the open micro-batch and frees its bytes (the call is over, or it stalled).
  void Clear() {
    current_.reset();
    hidden_digest_.reset();
    targets_digest_.reset();
    checked_ = {};
    skipping_ = false;
  }

 private:
  // Hands back the open micro-batch (digests attached) and closes it; with `skip_rest`, the rest
  // of its messages are skipped.
  AssembledMicroBatch Close(bool skip_rest);
  // Appends a message's hidden states to the open micro-batch, digesting them when its key may be
  // remembered and checking its whole elements.
  void AppendHidden(const StepMessage& message);
  // Appends `bytes` to the open micro-batch's buffer; returns where they landed.
  absl::string_view Store(absl::string_view bytes);

  // The NaN/Inf check of the open micro-batch's hidden states: its dtype (unset: the header's
  // dtype is not a float type, and Head::Step refuses it anyway), the bytes checked so far (whole
  // elements), whether a non-finite value was found and the largest magnitude (MaxAbs).
  struct FiniteCheck {
    std::optional<kernels::DType> dtype;
    size_t checked = 0;
    bool nonfinite = false;
    float max_abs = 0;  // of the elements checked (+Inf once nonfinite)
  };

  const size_t max_bytes_;
  const std::shared_ptr<PinnedPool> pinned_;
  FiniteCheck checked_;
  std::optional<AssembledMicroBatch> current_;
  std::optional<ByteDigest> hidden_digest_;
  std::optional<ByteDigest> targets_digest_;
  bool skipping_ = false;
};

// Bytes of tensor payload per response message: the limit less room for the other fields.
size_t ChunkPayloadBytes(size_t max_message_bytes);

// The first response of a micro-batch: its error (alone, last = true) or its result, which carries
// no payload (last = true when there is none to follow). `grad_hidden_shared`: dH was written into
// the client's shared memory (StepResult.grad_hidden_in_shared_memory) and is not sent.
v1::StepResponse FirstStepResponse(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, bool grad_hidden_shared = false);

// The payload of one response after the first: byte ranges of dH and of per-token losses.
// One tensor of a micro-batch's answer: its StepResponse field and bytes.
struct StepPayload {
  uint32_t field = 0;
  absl::string_view bytes;
};
// The tensors an answer sends, in the order it sends them: dH, per-token losses, the token
// outputs in TokenOutput order, then the top-k's ids and log-probs (their field numbers' order);
// empty ones left out, and dH with `grad_hidden_shared`.
std::vector<StepPayload> StepPayloads(const StepOutcome& outcome, bool grad_hidden_shared = false);

// A part of payload `tensor` (an index into StepPayloads) that one message carries.
struct StepSpan {
  size_t tensor = 0;
  size_t offset = 0;
  size_t bytes = 0;
};
// The messages after the first: the payloads one after another, at most `chunk_bytes` of them
// together per message.
std::vector<std::vector<StepSpan>> PlanStepPieces(const std::vector<StepPayload>& payloads,
                                                  size_t chunk_bytes);

// The responses of one micro-batch: an error alone (last = true), or the result followed by dH,
// per-token losses and token outputs, at most `chunk_bytes` of payload per message, last = true on
// the final one. (The server sends the same messages without copying the payload: step_wire.h.)
std::vector<v1::StepResponse> BuildStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_STEP_ASSEMBLER_H_
