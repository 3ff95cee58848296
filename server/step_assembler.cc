#include "server/step_assembler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/admission.h"

namespace losshead::server {

absl::StatusOr<std::optional<AssembledMicroBatch>> StepAssembler::Add(v1::StepRequest& request,
                                                                      absl::Time now) {
  if (request.has_header()) {
    if (current_.has_value()) {
      return absl::InvalidArgumentError(
          "malformed Step stream: a header arrived inside an open micro-batch");
    }
    current_.emplace();
    current_->microbatch.header = std::move(*request.mutable_header());
    current_->first_message = now;
  } else if (!current_.has_value()) {
    return absl::InvalidArgumentError(
        "malformed Step stream: a message without a header outside any micro-batch");
  }
  AssembledMicroBatch& mb = *current_;
  mb.last_message = now;
  mb.received_bytes += request.hidden().size() + request.targets().size();
  if (!mb.oversize && mb.received_bytes > max_bytes_) {
    // Stop buffering: the bytes seen so far are freed and the rest are only counted.
    mb.oversize = true;
    std::string().swap(mb.microbatch.hidden);
    std::string().swap(mb.microbatch.targets);
  }
  if (!mb.oversize && mb.refused.ok()) {
    // The first piece is moved rather than copied: single-message micro-batches copy nothing.
    if (mb.microbatch.hidden.empty()) {
      mb.microbatch.hidden = std::move(*request.mutable_hidden());
    } else {
      mb.microbatch.hidden.append(request.hidden());
    }
    if (mb.microbatch.targets.empty()) {
      mb.microbatch.targets = std::move(*request.mutable_targets());
    } else {
      mb.microbatch.targets.append(request.targets());
    }
  }
  if (!request.last()) return std::optional<AssembledMicroBatch>();
  std::optional<AssembledMicroBatch> done = std::move(current_);
  current_.reset();
  return done;
}

void StepAssembler::ReserveHidden(size_t bytes) {
  if (!buffering()) return;
  current_->microbatch.hidden.reserve(std::min(bytes, max_bytes_));
}

void StepAssembler::Refuse(absl::Status status) {
  AssembledMicroBatch& mb = *current_;
  mb.refused = std::move(status);
  std::string().swap(mb.microbatch.hidden);
  std::string().swap(mb.microbatch.targets);
}

size_t ChunkPayloadBytes(size_t max_message_bytes) {
  // Room for the result, ids and field tags; keep pieces 8-byte aligned for the reader's sake.
  constexpr size_t kOverhead = 1024;
  size_t payload =
      max_message_bytes > 2 * kOverhead ? max_message_bytes - kOverhead : max_message_bytes / 2;
  payload &= ~size_t{7};
  return std::max<size_t>(payload, 8);
}

std::vector<v1::StepResponse> BuildStepResponses(
    const v1::StepHeader& header, const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
    bool replayed, size_t chunk_bytes) {
  std::vector<v1::StepResponse> out;
  auto next = [&]() -> v1::StepResponse& {
    v1::StepResponse& r = out.emplace_back();
    r.set_client_id(header.client_id());
    r.set_sequence(header.sequence());
    return r;
  };
  if (!outcome.ok()) {
    v1::StepResponse& r = next();
    r.mutable_error()->set_code(static_cast<int>(outcome.status().code()));
    r.mutable_error()->set_message(std::string(outcome.status().message()));
    r.mutable_error()->set_retry_after_ms(RetryAfterMs(outcome.status()));
    r.set_last(true);
    return out;
  }
  const StepOutcome& o = **outcome;
  v1::StepResponse& first = next();
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
  // dH, then per-token losses, in pieces of at most chunk_bytes each (per message, both fields
  // together); the result message carries no payload so that it reaches the client first.
  size_t gh = 0;
  size_t pt = 0;
  while (gh < o.grad_hidden.size() || pt < o.per_token_loss.size()) {
    v1::StepResponse& r = next();
    size_t room = chunk_bytes;
    if (gh < o.grad_hidden.size()) {
      const size_t n = std::min(room, o.grad_hidden.size() - gh);
      r.set_grad_hidden(o.grad_hidden.substr(gh, n));
      gh += n;
      room -= n;
    }
    if (room > 0 && pt < o.per_token_loss.size()) {
      const size_t n = std::min(room, o.per_token_loss.size() - pt);
      r.set_per_token_loss(o.per_token_loss.substr(pt, n));
      pt += n;
    }
  }
  out.back().set_last(true);
  return out;
}

}  // namespace losshead::server
