// Running a Step stream's micro-batches (step_reactor.h): one at a time on the worker pool, each
// answered with its head's outcome or the refusal it was given, recorded in the metrics, and
// traced once its last answer is written.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/rpc/step_reactor.h"
#include "server/rpc/step_wire.h"

namespace losshead::server {

void StepReactor::StartNextSlotLocked() {
  if (computing_ || finished_ || cancelled_) return;
  for (const std::shared_ptr<Slot>& slot : slots_) {
    if (slot->started) continue;
    slot->started = true;
    computing_ = true;
    ++pins_;
    ctx_->pool->Schedule([this, slot] { RunSlot(slot); });
    return;
  }
}

void StepReactor::RunSlot(std::shared_ptr<Slot> slot) {
  const absl::Time picked = absl::Now();
  const MicroBatch& mb = slot->assembled.microbatch;
  const std::string& head_name = mb.header.head();
  StepStats stats;
  absl::StatusOr<std::shared_ptr<const StepOutcome>> outcome;
  bool known_head = false;
  bool refused_by_head = false;
  bool ordered = false;  // it took its place on the device: the next one may be running already
  bool gone;
  {
    absl::MutexLock lock(&mu_);
    gone = cancelled_;
  }
  if (!gone && call_ != nullptr && absl::FromChrono(call_->deadline()) <= picked) gone = true;
  if (gone) {
    // The caller cannot receive the answer: computing would only change dW behind its back.
    outcome = CancelStatus().error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                  ? absl::DeadlineExceededError(
                        "the Step call's deadline passed before this "
                        "micro-batch started")
                  : absl::CancelledError("the Step call was cancelled");
  } else if (!slot->assembled.refused.ok() || slot->assembled.oversize) {
    outcome = !slot->assembled.refused.ok()
                  ? slot->assembled.refused
                  : absl::ResourceExhaustedError(absl::StrCat(
                        "micro-batch exceeds the limit of ", ctx_->max_microbatch_bytes,
                        " bytes (--max_microbatch_bytes): ", slot->assembled.received_bytes,
                        " bytes received; the rest of it is skipped"));
    // Refused before it ran (at its header, by admission or by size): still an error of its
    // head, when there is one.
    refused_by_head = ctx_->registry->Get(head_name).ok();
  } else {
    absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(head_name);
    if (!head.ok()) {
      outcome = head.status();
    } else {
      known_head = true;
      outcome = (*head)->Step(mb, &stats, [this, &ordered] {
        absl::MutexLock lock(&mu_);
        ordered = true;
        computing_ = false;
        StartNextSlotLocked();
      });
    }
  }
  Metrics& m = *ctx_->metrics;
  if (known_head) {
    // Only existing heads get labelled series: a typo must not mint a new time series.
    m.StepPhase(head_name, "receive", slot->assembled.last_message - slot->assembled.first_message);
    m.StepPhase(head_name, "queue", (picked - slot->ready) + stats.queue);
    if (outcome.ok() && !stats.replayed) {
      m.StepPhase(head_name, "stage", stats.stage);
      m.StepPhase(head_name, "compute", stats.compute);
      for (const kernels::Backend* device : stats.devices) {
        const std::string label = ctx_->LabelOf(device);
        if (!label.empty()) m.DeviceBusy(label, stats.compute);
      }
      m.StepPhase(head_name, "finish", stats.finish);
    }
    if (!outcome.ok()) {
      m.Microbatch(head_name, "error", static_cast<int>(outcome.status().code()));
    } else if (stats.replayed) {
      m.Microbatch(head_name, "replayed");
    } else {
      // Evaluation apart from training: "ok" stays the rate of micro-batches counted in dW.
      m.Microbatch(head_name, (*outcome)->forward_only ? "forward" : "ok");
      m.MicrobatchLoss(head_name, (*outcome)->forward_only ? "forward" : "ok", (*outcome)->loss_sum,
                       (*outcome)->token_count);
      m.Tokens(head_name, (*outcome)->token_count);
    }
  } else if (refused_by_head) {
    m.Microbatch(head_name, "error", static_cast<int>(outcome.status().code()));
  } else {
    m.Failure("Step", static_cast<int>(outcome.status().code()));
  }
  if (outcome.ok()) {
    m.Bytes("Step", "out", (*outcome)->grad_hidden.size() + (*outcome)->per_token_loss.size());
  }
  std::vector<grpc::ByteBuffer> responses = EncodeStepResponses(
      mb.header, outcome, stats.replayed, ChunkPayloadBytes(ctx_->max_message_bytes));
  {
    absl::MutexLock lock(&mu_);
    slot->responses = std::move(responses);
    slot->picked = picked;
    slot->stats = stats;
    slot->code = static_cast<int>(outcome.status().code());
    slot->done = true;
    slot->head_known = known_head;
    // The request's tensors are no longer needed; free them before the responses drain.
    slot->assembled.microbatch.ReleaseTensors();
    BookAnswerLocked(*slot, outcome.ok()
                                ? (*outcome)->grad_hidden.size() + (*outcome)->per_token_loss.size()
                                : 0);
    if (!ordered) computing_ = false;
    StartNextSlotLocked();
  }
  Pump();
  Unpin();
}

StepTraceRecord StepReactor::TraceRecord(const Slot& slot) {
  const v1::StepHeader& h = slot.assembled.microbatch.header;
  return StepTraceRecord{.head = h.head(),
                         .client_id = h.client_id(),
                         .sequence = h.sequence(),
                         .tokens = h.num_tokens(),
                         .code = slot.code,
                         .replayed = slot.stats.replayed,
                         .first_message = slot.assembled.first_message,
                         .last_message = slot.assembled.last_message,
                         .picked = slot.picked,
                         .stage = slot.stats.stage_start,
                         .compute = slot.stats.compute_start,
                         .compute_end = slot.stats.compute_end,
                         .finish_end = slot.stats.finish_end,
                         .first_send = slot.first_send,
                         .sent = absl::Now()};
}

}  // namespace losshead::server
