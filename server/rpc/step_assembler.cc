#include "server/rpc/step_assembler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/admission.h"
#include "server/engine/proto_convert.h"

namespace losshead::server {

namespace {

// How much of a message's hidden states is copied before it is digested and checked: small enough
// to be still in cache for those passes (each byte then leaves memory once and enters it once).
constexpr size_t kCacheStepBytes = size_t{256} << 10;

}  // namespace

absl::StatusOr<std::optional<AssembledMicroBatch>> StepAssembler::Add(v1::StepRequest& request,
                                                                      absl::Time now) {
  StepMessage message;
  message.request.Swap(&request);
  // The pieces refer to the request's own bytes, which outlive this call (they are swapped back).
  const std::string& hidden = *message.request.mutable_hidden();
  if (!hidden.empty()) {
    message.hidden.emplace_back(reinterpret_cast<const uint8_t*>(hidden.data()), hidden.size());
    message.hidden_bytes = hidden.size();
  }
  auto added = Add(message, now);
  message.request.Swap(&request);
  return added;
}

absl::StatusOr<std::optional<AssembledMicroBatch>> StepAssembler::Add(StepMessage& message,
                                                                      absl::Time now,
                                                                      size_t reserve_bytes) {
  v1::StepRequest& request = message.request;
  if (request.has_header()) {
    if (current_.has_value()) {
      return absl::InvalidArgumentError(
          "malformed Step stream: a header arrived inside an open micro-batch");
    }
    // A header ends the skipping of a refused micro-batch: its remaining messages may be left out.
    skipping_ = false;
    current_.emplace();
    current_->microbatch.header = std::move(*request.mutable_header());
    current_->first_message = now;
    const v1::StepHeader& header = current_->microbatch.header;
    checked_ = {};
    if (auto dtype = FloatDType(header.hidden_dtype(), "hidden_dtype"); dtype.ok()) {
      checked_.dtype = *dtype;
    }
    // Only a key the server may remember needs a fingerprint.
    if (!header.client_id().empty() && !header.options().forward_only()) {
      hidden_digest_.emplace();
      targets_digest_.emplace();
    }
    // A micro-batch from shared memory comes whole in its one message, and large: it is copied
    // into a reused page-locked buffer too, rather than into fresh memory that faults in.
    if (reserve_bytes > 0 && (!request.last() || message.shared)) ReserveHidden(reserve_bytes);
  } else if (!current_.has_value()) {
    if (skipping_) {
      skipping_ = !request.last();
      return std::optional<AssembledMicroBatch>();
    }
    return absl::InvalidArgumentError(
        "malformed Step stream: a message without a header outside any micro-batch");
  }
  AssembledMicroBatch& mb = *current_;
  mb.last_message = now;
  mb.received_bytes += message.bytes();
  if (!mb.oversize && mb.received_bytes > max_bytes_) {
    // Refused for good: hand it back now and skip what is left of it.
    mb.oversize = true;
    mb.microbatch.ReleaseTensors();
    return Close(!request.last());
  }
  if (!mb.oversize && mb.refused.ok()) {
    if (targets_digest_.has_value()) targets_digest_->Update(request.targets());
    std::string& hidden = mb.microbatch.hidden;
    if (mb.microbatch.pinned_hidden == nullptr &&
        hidden.size() + message.hidden_bytes > hidden.capacity()) {
      // Once for a micro-batch of one message; by doubling past what ReserveHidden gave.
      hidden.reserve(std::max<size_t>(hidden.size() + message.hidden_bytes, 2 * hidden.capacity()));
    }
    AppendHidden(message);
    if (mb.microbatch.targets.empty()) {
      mb.microbatch.targets = std::move(*request.mutable_targets());
    } else {
      mb.microbatch.targets.append(request.targets());
    }
    // The per-token inputs, in TokenInput order (their StepRequest fields' order).
    std::string* pieces[kTokenInputs] = {request.mutable_token_weights(),
                                         request.mutable_old_logprob(),
                                         request.mutable_advantages(),
                                         request.mutable_ref_logprob()};
    for (int i = 0; i < kTokenInputs; ++i) {
      std::string& to = mb.microbatch.token_inputs[i];
      if (to.empty()) {
        to = std::move(*pieces[i]);
      } else {
        to.append(*pieces[i]);
      }
    }
  }
  if (!request.last()) return std::optional<AssembledMicroBatch>();
  return Close(false);
}

AssembledMicroBatch StepAssembler::Close(bool skip_rest) {
  AssembledMicroBatch done = *std::move(current_);
  current_.reset();
  if (hidden_digest_.has_value() && !done.oversize && done.refused.ok()) {
    done.microbatch.hidden_digest = hidden_digest_->Value();
    done.microbatch.targets_digest = targets_digest_->Value();
  }
  // A value found stands; "none found" only from a check that covered every byte (a trailing
  // partial element means a size Head::Step refuses anyway).
  if (checked_.dtype.has_value() && !done.oversize && done.refused.ok() &&
      (checked_.nonfinite || checked_.checked == done.microbatch.hidden_bytes().size())) {
    done.microbatch.hidden_max_abs = checked_.max_abs;
  }
  checked_ = {};
  hidden_digest_.reset();
  targets_digest_.reset();
  skipping_ = skip_rest;
  return done;
}

void StepAssembler::AppendHidden(const StepMessage& message) {
  for (const auto& [data, size] : message.hidden) {
    for (size_t done = 0; done < size;) {
      const size_t n = std::min(kCacheStepBytes, size - done);
      const absl::string_view landed =
          Store(absl::string_view(reinterpret_cast<const char*>(data) + done, n));
      done += n;
      if (hidden_digest_.has_value()) hidden_digest_->Update(landed);
      if (!checked_.dtype.has_value() || checked_.nonfinite) continue;
      // Whole elements only: a step may end inside one, which the next step completes.
      const absl::string_view all = current_->microbatch.hidden_bytes();
      const size_t element = kernels::DTypeSize(*checked_.dtype);
      const size_t whole = all.size() / element * element;
      if (whole > checked_.checked) {
        const float max_abs = kernels::MaxAbs(*checked_.dtype, all.data() + checked_.checked,
                                              (whole - checked_.checked) / element);
        checked_.max_abs = std::max(checked_.max_abs, max_abs);
        checked_.nonfinite = !std::isfinite(max_abs);
        checked_.checked = whole;
      }
    }
  }
}

absl::string_view StepAssembler::Store(absl::string_view bytes) {
  MicroBatch& mb = current_->microbatch;
  if (mb.pinned_hidden != nullptr) {
    const size_t at = mb.pinned_hidden->size();
    if (mb.pinned_hidden->Append(bytes)) return mb.pinned_hidden->view().substr(at);
    // More than the header announced (Head::Step refuses the size): go on in ordinary memory.
    const absl::string_view so_far = mb.pinned_hidden->view();
    mb.hidden.assign(so_far.data(), so_far.size());
    mb.pinned_hidden.reset();
  }
  const size_t at = mb.hidden.size();
  mb.hidden.append(bytes.data(), bytes.size());
  return absl::string_view(mb.hidden).substr(at);
}

void StepAssembler::ReserveHidden(size_t bytes) {
  if (!buffering()) return;
  MicroBatch& mb = current_->microbatch;
  const size_t want = std::min(bytes, max_bytes_);
  if (pinned_ != nullptr && mb.pinned_hidden == nullptr) {
    if (PinnedBytes pinned = pinned_->Take(want); pinned && pinned.Append(mb.hidden)) {
      mb.pinned_hidden = std::make_shared<PinnedBytes>(std::move(pinned));
      std::string().swap(mb.hidden);
      return;
    }
  }
  mb.hidden.reserve(want);
}

AssembledMicroBatch StepAssembler::Refuse(absl::Status status) {
  AssembledMicroBatch& mb = *current_;
  mb.refused = std::move(status);
  mb.microbatch.ReleaseTensors();
  return Close(true);
}

size_t ChunkPayloadBytes(size_t max_message_bytes) {
  // Room for the result, ids and field tags; keep pieces 8-byte aligned for the reader's sake.
  constexpr size_t kOverhead = 1024;
  size_t payload =
      max_message_bytes > 2 * kOverhead ? max_message_bytes - kOverhead : max_message_bytes / 2;
  payload &= ~size_t{7};
  return std::max<size_t>(payload, 8);
}

v1::StepResponse FirstStepResponse(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, bool grad_hidden_shared) {
  v1::StepResponse first;
  first.set_client_id(header.client_id());
  first.set_sequence(header.sequence());
  if (!outcome.ok()) {
    first.mutable_error()->set_code(static_cast<int>(outcome.status().code()));
    first.mutable_error()->set_message(std::string(outcome.status().message()));
    first.mutable_error()->set_retry_after_ms(RetryAfterMs(outcome.status()));
    first.set_last(true);
    return first;
  }
  const StepOutcome& o = **outcome;
  v1::StepResult* result = first.mutable_result();
  result->set_loss_sum(o.loss_sum);
  result->set_token_count(o.token_count);
  result->set_loss(o.loss);
  result->set_weights_version(o.weights_version);
  result->set_replayed(replayed);
  result->set_forward_only(o.forward_only);
  result->set_grad_hidden_dtype(o.grad_hidden_dtype);
  result->set_grad_hidden_bytes(o.grad_hidden.size());
  result->set_per_token_loss_bytes(o.per_token_loss.size());
  result->set_per_token_logprob_bytes(o.token_output(TokenOutput::kLogprob).size());
  result->set_per_token_entropy_bytes(o.token_output(TokenOutput::kEntropy).size());
  result->set_per_token_lse_bytes(o.token_output(TokenOutput::kLse).size());
  result->set_per_token_argmax_bytes(o.token_output(TokenOutput::kArgmax).size());
  result->set_top_k_ids_bytes(o.top_k_ids.size());
  result->set_top_k_logprobs_bytes(o.top_k_logprobs.size());
  if (o.correct_count.has_value()) result->set_correct_count(*o.correct_count);
  result->set_grad_hidden_in_shared_memory(grad_hidden_shared);
  // The result message carries no payload so that it reaches the client first.
  first.set_last(o.payload_bytes() - (grad_hidden_shared ? o.grad_hidden.size() : 0) == 0);
  return first;
}

std::vector<StepPayload> StepPayloads(const StepOutcome& o, bool grad_hidden_shared) {
  // StepResponse's payload fields (proto/losshead/v1/losshead.proto).
  constexpr uint32_t kGradHiddenField = 5;
  constexpr uint32_t kPerTokenLossField = 6;
  constexpr uint32_t kFirstTokenOutputField = 8;  // then one per TokenOutput, in order
  constexpr uint32_t kTopKIdsField = 12;
  constexpr uint32_t kTopKLogprobsField = 13;
  std::vector<StepPayload> out;
  if (!o.grad_hidden.empty() && !grad_hidden_shared) {
    out.push_back({kGradHiddenField, o.grad_hidden});
  }
  if (!o.per_token_loss.empty()) out.push_back({kPerTokenLossField, o.per_token_loss});
  for (int i = 0; i < kTokenOutputs; ++i) {
    if (o.token_outputs[i].empty()) continue;
    out.push_back({kFirstTokenOutputField + static_cast<uint32_t>(i), o.token_outputs[i]});
  }
  if (!o.top_k_ids.empty()) out.push_back({kTopKIdsField, o.top_k_ids});
  if (!o.top_k_logprobs.empty()) out.push_back({kTopKLogprobsField, o.top_k_logprobs});
  return out;
}

std::vector<std::vector<StepSpan>> PlanStepPieces(const std::vector<StepPayload>& payloads,
                                                  size_t chunk_bytes) {
  std::vector<std::vector<StepSpan>> pieces;
  size_t room = 0;
  for (size_t t = 0; t < payloads.size(); ++t) {
    const size_t size = payloads[t].bytes.size();
    for (size_t at = 0; at < size;) {
      if (room == 0) {
        pieces.emplace_back();
        room = chunk_bytes;
      }
      const size_t take = std::min(room, size - at);
      pieces.back().push_back({.tensor = t, .offset = at, .bytes = take});
      at += take;
      room -= take;
    }
  }
  return pieces;
}

std::vector<v1::StepResponse> BuildStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes) {
  std::vector<v1::StepResponse> out;
  out.push_back(FirstStepResponse(header, outcome, replayed));
  if (!outcome.ok()) return out;
  const std::vector<StepPayload> payloads = StepPayloads(**outcome);
  const std::vector<std::vector<StepSpan>> pieces = PlanStepPieces(payloads, chunk_bytes);
  const google::protobuf::Descriptor* descriptor = v1::StepResponse::descriptor();
  const google::protobuf::Reflection* reflection = v1::StepResponse::GetReflection();
  for (size_t i = 0; i < pieces.size(); ++i) {
    v1::StepResponse& r = out.emplace_back();
    r.set_client_id(header.client_id());
    r.set_sequence(header.sequence());
    for (const StepSpan& span : pieces[i]) {
      const StepPayload& payload = payloads[span.tensor];
      reflection->SetString(&r, descriptor->FindFieldByNumber(static_cast<int>(payload.field)),
                            std::string(payload.bytes.substr(span.offset, span.bytes)));
    }
    r.set_last(i + 1 == pieces.size());
  }
  return out;
}

}  // namespace losshead::server
