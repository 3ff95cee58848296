// Running a Step stream's micro-batches (step_reactor.h): one at a time on the worker pool, each
// answered with its head's outcome or the refusal it was given, recorded in the metrics, and
// traced once its last answer is written.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/parallel_copy.h"
#include "server/observability/microbatch_metrics.h"
#include "server/rpc/control_service.h"
#include "server/rpc/group_control.h"
#include "server/rpc/step_reactor.h"
#include "server/rpc/step_wire.h"

namespace losshead::server {
namespace {

// What an OK answer sends: dH, the per-token losses and token outputs.
size_t SentBytes(const StepOutcome& outcome) { return outcome.payload_bytes(); }

// What the micro-batch asked for and ran, for its counters: an embedding gradient's rows, or the
// outputs asked (each present in the outcome exactly when asked) and the loss's kind and terms.
void RecordAsked(const v1::StepHeader& header, const StepOutcome& outcome,
                 MicrobatchRecord& record) {
  if (header.kind() == v1::STEP_KIND_EMBEDDING_GRAD) {
    record.embedding_grad_rows = header.num_tokens();
    return;
  }
  record.output_tokens = header.num_tokens();
  for (int i = 0; i < kTokenOutputs; ++i) {
    record.token_outputs[i] = !outcome.token_outputs[i].empty();
  }
  record.top_k = !outcome.top_k_ids.empty();
  record.policy_gradient = outcome.policy_gradient;
  record.entropy_term = outcome.entropy_term;
  record.kl_term = outcome.kl_term;
  for (int input : header.token_inputs()) {
    if (input == v1::TOKEN_INPUT_WEIGHT) record.token_weights = true;
  }
}

}  // namespace

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
  SlotRun run;
  ComputeSlot(*slot, picked, run);
  WriteSharedGradHidden(*slot, run);
  RecordSlot(*slot, picked, run);
  std::vector<grpc::ByteBuffer> responses =
      EncodeStepResponses(slot->assembled.microbatch.header, run.outcome, run.stats.replayed,
                          ChunkPayloadBytes(ctx_->max_message_bytes), run.grad_hidden_shared);
  {
    absl::MutexLock lock(&mu_);
    CompleteSlotLocked(*slot, std::move(responses), picked, run);
    if (!run.ordered) computing_ = false;
    StartNextSlotLocked();
  }
  Pump();
  Unpin();
}

void StepReactor::ComputeSlot(Slot& slot, absl::Time picked, SlotRun& run) {
  MicroBatch& mb = slot.assembled.microbatch;
  bool gone;
  {
    absl::MutexLock lock(&mu_);
    gone = cancelled_;
  }
  if (!gone && call_ != nullptr && absl::FromChrono(call_->deadline()) <= picked) gone = true;
  if (gone) {
    // The caller cannot receive the answer: computing would only change dW behind its back.
    run.outcome = CancelStatus().error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                      ? absl::DeadlineExceededError(
                            "the Step call's deadline passed before this "
                            "micro-batch started")
                      : absl::CancelledError("the Step call was cancelled");
    return;
  }
  if (!slot.assembled.refused.ok() || slot.assembled.oversize) {
    run.outcome = !slot.assembled.refused.ok()
                      ? slot.assembled.refused
                      : absl::ResourceExhaustedError(absl::StrCat(
                            "micro-batch exceeds the limit of ", ctx_->max_microbatch_bytes,
                            " bytes (--max_microbatch_bytes): ", slot.assembled.received_bytes,
                            " bytes received; the rest of it is skipped"));
    // Refused before it ran (at its header, by admission or by size): still an error of its
    // head, when there is one.
    if (ctx_->registry->Get(mb.header.head()).ok()) run.reach = MicrobatchRecord::Reach::kRefused;
    return;
  }
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(mb.header.head());
  if (!head.ok()) {
    run.outcome = head.status();
    return;
  }
  absl::Duration copied_out;
  if (slot.input.region != nullptr) {
    // Out of the client's device region now, on this worker and outside mu_: the stream reads
    // and admits its next messages meanwhile. Still before the next slot may start (computing_),
    // so the stream's micro-batches reach dW in order.
    const absl::Time start = absl::Now();
    if (absl::Status taken = TakeRegionInput(slot.input, ctx_->pinned.get(), mb); !taken.ok()) {
      run.outcome = taken;
      run.reach = MicrobatchRecord::Reach::kRefused;
      return;
    }
    copied_out = absl::Now() - start;
    const uint64_t bytes = slot.input.hidden_bytes + slot.input.targets_bytes;
    ctx_->metrics->Bytes("Step", "in", bytes);
    ctx_->metrics->StepDataBytes("device", "in", bytes);
  }
  if (const DeviceMapping* device =
          slot.shared.region != nullptr ? slot.shared.region->device() : nullptr;
      device != nullptr) {
    // dH into the client's device region from the device that computes it, not through this
    // host (WriteSharedGradHidden's way, still taken for a replay or should that copy fail).
    mb.grad_hidden_to = static_cast<uint8_t*>(device->data()) + slot.shared.grad_offset;
    mb.grad_hidden_to_bytes = slot.shared.grad_bytes;
  }
  run.reach = MicrobatchRecord::Reach::kRan;
  // Once this micro-batch's place is fixed, the stream's next one may start.
  const std::function<void()> ordered = [this, &run] {
    absl::MutexLock lock(&mu_);
    run.ordered = true;
    computing_ = false;
    StartNextSlotLocked();
  };
  if (ctx_->group != nullptr && (*head)->across_processes()) {
    // Sharded across processes: run on every process in the leader's order (group_control.h).
    run.outcome =
        ctx_->group->Step(**head, mb, &run.stats,
                          call_ != nullptr ? AuthorizationOf(*call_) : std::string(), ordered);
  } else {
    run.outcome = (*head)->Step(mb, &run.stats, ordered);
  }
  // The copy out of a device region is the micro-batch's first copy in: its stage phase.
  run.stats.stage += copied_out;
}

void StepReactor::WriteSharedGradHidden(const Slot& slot, SlotRun& run) {
  if (slot.shared.region == nullptr || !run.outcome.ok()) return;
  const std::string& grad = (**run.outcome).grad_hidden;
  // The header's range was checked to hold dH before the micro-batch ran; a replay carries the
  // same options, so the same size. Should it ever not fit, dH goes on the stream instead.
  if (grad.empty() || grad.size() > slot.shared.grad_bytes) return;
  if (const DeviceMapping* device = slot.shared.region->device(); device != nullptr) {
    const std::optional<absl::Status>& delivered = run.stats.grad_hidden_delivery;
    if (delivered.has_value() && delivered->ok()) {
      run.grad_hidden_shared = true;  // copied there from the computing device, and waited for
      return;
    }
    if (delivered.has_value()) {
      std::fprintf(stderr,
                   "losshead-server: dH not copied into device region %llu from the device (%s): "
                   "copying it from the host\n",
                   static_cast<unsigned long long>(slot.shared.region->id()),
                   delivered->ToString().c_str());
    }
    // Synchronous: dH is in the client's device memory before the answer says so.
    if (absl::Status copied = device->CopyIn(slot.shared.grad_offset, grad.data(), grad.size());
        !copied.ok()) {
      // dH goes on the stream instead; the client still gets it, more slowly.
      std::fprintf(stderr, "losshead-server: dH not written into device region %llu: %s\n",
                   static_cast<unsigned long long>(slot.shared.region->id()),
                   copied.ToString().c_str());
      return;
    }
  } else {
    ParallelCopy(slot.shared.region->data() + slot.shared.grad_offset, grad.data(), grad.size());
  }
  run.grad_hidden_shared = true;
}

void StepReactor::RecordSlot(const Slot& slot, absl::Time picked, const SlotRun& run) {
  const StepStats& stats = run.stats;
  MicrobatchRecord record{.reach = run.reach,
                          .code = static_cast<int>(run.outcome.status().code()),
                          .replayed = stats.replayed,
                          .receive = slot.assembled.last_message - slot.assembled.first_message,
                          .queue = (picked - slot.ready) + stats.queue,
                          .stage = stats.stage,
                          .compute = stats.compute,
                          .finish = stats.finish};
  if (run.outcome.ok()) {
    const StepOutcome& outcome = **run.outcome;
    record.forward_only = outcome.forward_only;
    record.loss_sum = outcome.loss_sum;
    record.tokens = outcome.token_count;
    record.bytes_out = SentBytes(outcome);
    RecordAsked(slot.assembled.microbatch.header, outcome, record);
    // Every payload byte answered, whichever way it went; and by path.
    const size_t shared = run.grad_hidden_shared ? outcome.grad_hidden.size() : 0;
    const bool device = slot.shared.region != nullptr && slot.shared.region->device() != nullptr;
    ctx_->metrics->StepDataBytes(device ? "device" : "shared_memory", "out", shared);
    ctx_->metrics->StepDataBytes("network", "out", record.bytes_out - shared);
  }
  RecordMicrobatch(*ctx_->metrics, slot.assembled.microbatch.header.head(), record,
                   stats.devices.size(),
                   [this, &stats](size_t i) { return ctx_->LabelOf(stats.devices[i]); });
}

void StepReactor::CompleteSlotLocked(Slot& slot, std::vector<grpc::ByteBuffer> responses,
                                     absl::Time picked, SlotRun& run) {
  slot.responses = std::move(responses);
  slot.picked = picked;
  slot.stats = std::move(run.stats);
  slot.code = static_cast<int>(run.outcome.status().code());
  slot.done = true;
  slot.shared = {};  // its region may be unmapped now (its client gone), nothing more is written
  slot.input = {};
  slot.head_known = run.reach == MicrobatchRecord::Reach::kRan;
  // The request's tensors are no longer needed; free them before the responses drain.
  slot.assembled.microbatch.ReleaseTensors();
  BookAnswerLocked(slot, run.outcome.ok() ? SentBytes(**run.outcome) : 0);
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
