#include "server/rpc/step_reactor.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "server/rpc/status_util.h"
#include "server/rpc/step_wire.h"
#include "server/security/auth.h"

namespace losshead::server {
namespace {

// The `hidden` field of StepRequest (proto/losshead/v1/losshead.proto).
constexpr uint32_t kRequestHiddenField = 2;

// The micro-batches an unread-answer status names at most (a stream holds
// --max_inflight_per_stream of them).
constexpr size_t kNamedMicrobatches = 16;

}  // namespace

void StepStreams::Add(StepReactor* reactor) {
  absl::MutexLock lock(&mu_);
  live_.insert(reactor);
}

void StepStreams::Remove(StepReactor* reactor) {
  absl::MutexLock lock(&mu_);
  live_.erase(reactor);
}

void StepStreams::DrainAll() {
  std::vector<StepReactor*> pinned;
  {
    absl::MutexLock lock(&mu_);
    for (StepReactor* r : live_) {
      r->BeginDrain();
      pinned.push_back(r);
    }
  }
  for (StepReactor* r : pinned) r->EndDrain();
}

bool StepStreams::WaitUntilNone(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](absl::flat_hash_set<StepReactor*>* live) { return live->empty(); }, &live_),
      deadline);
}

StepReactor::StepReactor(ServiceContext* ctx, grpc::CallbackServerContext* call)
    : ctx_(ctx),
      call_(call),
      start_(absl::Now()),
      progress_step_(ChunkPayloadBytes(ctx->max_message_bytes)),
      assembler_(ctx->max_microbatch_bytes, ctx->pinned) {
  // Register before looking at the flag: a concurrent shutdown either sees this stream or this
  // stream sees the flag.
  ctx_->streams.Add(this);
  if (ctx_->draining.load()) {
    absl::MutexLock lock(&mu_);
    draining_ = true;
  }
  Pump();
}

void StepReactor::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  ++pins_;
}

void StepReactor::EndDrain() {
  Pump();
  Unpin();
}

void StepReactor::Pump() {
  const grpc::ByteBuffer* write = nullptr;
  bool read = false;
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    // While the call is being cancelled it must not finish (OnDone would free it under the
    // cancel); the canceller pumps again afterwards.
    if (finished_ || cancelling_) return;
    if (pending_finish_.has_value()) {
      finish = std::move(pending_finish_);
      pending_finish_.reset();
    } else {
      if (!writing_ && !slots_.empty() && slots_.front()->done) {
        Slot& slot = *slots_.front();
        write_started_ = absl::Now();  // the unread timer's only cost per response message
        if (slot.next == 0) slot.first_send = write_started_;
        write = &slot.responses[slot.next];
        writing_ = true;
        const absl::Duration unread = ctx_->admission != nullptr ? ctx_->admission->unread_timeout()
                                                                 : absl::InfiniteDuration();
        if (!alarm_pending_[kUnread] && unread != absl::InfiniteDuration()) {
          ArmAlarmLocked(kUnread, write_started_ + unread);
        }
      }
      if (!reading_ && !read_closed_ && !draining_ && !cancelled_ && !end_status_.has_value() &&
          slots_.size() < ctx_->max_inflight_per_stream) {
        reading_ = true;
        read = true;
        read_started_ = absl::Now();  // the stall timer's only cost per message
      }
      if (!writing_ && slots_.empty() &&
          (read_closed_ || draining_ || cancelled_ || end_status_.has_value())) {
        finish = end_status_.has_value() ? *end_status_
                 : cancelled_            ? CancelStatus()
                 : read_closed_          ? grpc::Status::OK
                                         : grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                        "the server is shutting down; no further "
                                                        "micro-batches are read on this stream");
      }
    }
    if (finish.has_value()) {
      finished_ = true;
      final_status_ = *finish;
    }
  }
  if (write != nullptr) StartWrite(write);
  if (read) StartRead(&read_buffer_);
  if (finish.has_value()) Finish(*finish);
}

void StepReactor::OnReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    // Parsed but for the hidden states, which stay in the slices until the assembler copies them
    // to their buffer; a message that does not parse ends the call rather than pass for the end
    // of the stream.
    if (ok) {
      const bool parsed = transport::wire::ParseWithoutData(read_buffer_, kRequestHiddenField,
                                                     &message_.request, &hidden_slices_)
                              .ok();
      message_.hidden.swap(hidden_slices_.pieces);
      message_.hidden_bytes = hidden_slices_.size;
      if (!parsed) {
        ok = false;
        EndLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               "malformed Step stream: a message is not a StepRequest"));
      }
    }
    if (!ok) {
      read_closed_ = true;
      if (assembler_.open()) {
        EndLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               "malformed Step stream: it ended inside a micro-batch"));
      }
      // A partial micro-batch can never complete now: free its bytes at once.
      assembler_.Clear();
      ReleaseOpenLocked();
    } else if (!finished_ && !cancelled_ && !end_status_.has_value()) {
      const absl::Time now = absl::Now();
      ctx_->metrics->Bytes("Step", "in", message_.bytes());
      ReceiveLocked(message_, now);
      const absl::Duration stall =
          ctx_->admission != nullptr ? ctx_->admission->stall_timeout() : absl::InfiniteDuration();
      // One alarm at a time covers every micro-batch of the stream: it re-arms while one is open.
      if (assembler_.open() && !alarm_pending_[kStall] && stall != absl::InfiniteDuration()) {
        ArmAlarmLocked(kStall, now + (stall - stall_waited_));
      }
    }
    // After a stall or malformed input, whatever still arrives is dropped: the stream ends once
    // its earlier micro-batches are answered.
    message_.Clear();
    hidden_slices_ = {};
    read_buffer_.Clear();
  }
  Pump();
}

void StepReactor::ReceiveLocked(StepMessage& message, absl::Time now) {
  const bool opens = message.request.has_header() && !assembler_.open();
  // Admitted (and reserved) before anything is buffered.
  const absl::Status admitted = opens ? AdmitHeaderLocked(message) : AdmitPieceLocked(message);
  // A micro-batch of several messages gets its buffer sized from the header, once.
  const size_t reserve = opens && admitted.ok() ? open_announced_ : 0;
  auto assembled = assembler_.Add(message, now, reserve);
  if (!assembled.ok()) {
    // Malformed: nothing more is read, and the micro-batches before it are still answered.
    assembler_.Clear();
    ReleaseOpenLocked();
    EndLocked(ToGrpcStatus(assembled.status()));
    return;
  }
  if (assembled->has_value()) {
    AssembledMicroBatch& mb = **assembled;
    if (!admitted.ok() && mb.refused.ok()) {
      mb.refused = admitted;
      mb.microbatch.ReleaseTensors();
    }
    EnqueueLocked(std::move(mb), now);
  } else if (assembler_.open()) {
    if (!admitted.ok()) {
      // Answered now, before the rest of it is read (and then skipped).
      EnqueueLocked(assembler_.Refuse(admitted), now);
    } else if (opens || open_received_ >= progress_at_) {
      // Progress (its header, or another step of bytes): the stall clock starts afresh.
      stall_waited_ = absl::ZeroDuration();
      progress_at_ = open_received_ + progress_step_;
    } else {
      stall_waited_ += now - read_started_;
    }
  }
}

void StepReactor::EndLocked(grpc::Status status) {
  if (finished_ || cancelled_ || end_status_.has_value()) return;
  end_status_ = std::move(status);
}

void StepReactor::EnqueueLocked(AssembledMicroBatch assembled, absl::Time now) {
  auto slot = std::make_shared<Slot>();
  slot->assembled = std::move(assembled);
  slot->ready = now;
  if (slot->assembled.oversize || !slot->assembled.refused.ok()) {
    ReleaseOpenLocked();
  } else {
    slot->admitted = open_admitted_;
    slot->reserved = open_reserved_;
    open_admitted_ = false;
    open_reserved_ = 0;
  }
  open_received_ = 0;
  open_announced_ = 0;
  slots_.push_back(std::move(slot));
  ++inflight_;
  ctx_->metrics->InflightAdd(1);
  StartNextSlotLocked();
}

void StepReactor::ArmAlarmLocked(Timer timer, absl::Time when) {
  ++pins_;  // the alarm's callback uses `this`
  alarm_pending_[timer] = true;
  // A spent alarm (its callback has begun, perhaps this very one) may be destroyed: gRPC keeps
  // what a running callback needs alive until it returns. The callback runs on gRPC's executor
  // threads, never inside Set, so setting it under mu_ is safe.
  alarms_[timer] = std::make_unique<grpc::Alarm>();
  if (timer == kStall) {
    alarms_[timer]->Set(absl::ToChronoTime(when), [this](bool fired) { OnStallAlarm(fired); });
  } else {
    alarms_[timer]->Set(absl::ToChronoTime(when), [this](bool fired) { OnUnreadAlarm(fired); });
  }
}

void StepReactor::OnStallAlarm(bool fired) {
  bool stalled = false;
  {
    absl::MutexLock lock(&mu_);
    alarm_pending_[kStall] = false;
    if (fired && !finished_ && !cancelled_ && !end_status_.has_value() && assembler_.open()) {
      const absl::Duration timeout = ctx_->admission->stall_timeout();
      const absl::Time now = absl::Now();
      // Only a read the server is waiting on counts: while reading pauses (the stream's
      // micro-batches ahead are being answered) the client cannot send.
      const absl::Duration waited =
          stall_waited_ + (reading_ ? now - read_started_ : absl::ZeroDuration());
      if (waited >= timeout) {
        const v1::StepHeader& h = assembler_.open_header();
        end_status_ = grpc::Status(
            grpc::StatusCode::ABORTED,
            absl::StrCat(
                "micro-batch (head '", h.head(), "', client '", h.client_id(), "', sequence ",
                h.sequence(), ") made no progress for ", absl::ToDoubleSeconds(waited),
                " s (--step_stall_timeout=", absl::FormatDuration(timeout), "; ", open_received_,
                " of ", open_announced_, " bytes received, and each ", progress_step_,
                " more, or its end, must come within the timeout): it was abandoned and its "
                "reservation released, and nothing of it was counted; send it again on a new "
                "stream"));
        assembler_.Clear();
        ReleaseOpenLocked();
        open_received_ = 0;
        open_announced_ = 0;
        ctx_->metrics->StalledMicrobatch();
        stalled = true;
      } else {
        ArmAlarmLocked(kStall, now + (timeout - waited));
      }
    }
  }
  if (stalled) Pump();
  Unpin();
}

void StepReactor::OnUnreadAlarm(bool fired) {
  std::optional<grpc::Status> abandoned;
  {
    absl::MutexLock lock(&mu_);
    alarm_pending_[kUnread] = false;
    if (fired && !finished_ && !cancelled_ && writing_) {
      const absl::Duration timeout = ctx_->admission->unread_timeout();
      const absl::Time now = absl::Now();
      if (now - write_started_ >= timeout) {
        abandoned = AbandonUnreadLocked(now - write_started_);
        cancelling_ = call_ != nullptr;
      } else {
        ArmAlarmLocked(kUnread, write_started_ + timeout);
      }
    }
  }
  if (abandoned.has_value()) {
    if (call_ != nullptr) {
      // The pending write cannot complete while the client does not read, and neither can a
      // Finish queued behind it: only a cancel ends the call (and frees the bytes gRPC holds).
      // With a status, the client is told why (gRPC sends it in place of the queued data).
      // Outside mu_: the cancel may run reactions of this reactor inline.
      grpc_call_cancel_with_status(call_->c_call(), GRPC_STATUS_ABORTED,
                                   abandoned->error_message().c_str(), nullptr);
      absl::MutexLock lock(&mu_);
      cancelling_ = false;
    }
    Pump();
  }
  Unpin();
}

grpc::Status StepReactor::AbandonUnreadLocked(absl::Duration waited) {
  // Named before anything is dropped: every micro-batch whose answer the client has not had.
  std::string computed, started, dropped;
  size_t named = 0;
  for (const std::shared_ptr<Slot>& slot : slots_) {
    const v1::StepHeader& h = slot->assembled.microbatch.header;
    std::string& list = slot->done ? computed : slot->started ? started : dropped;
    if (named++ == kNamedMicrobatches) {
      absl::StrAppend(&list, list.empty() ? "" : ", ", "...");
      continue;
    }
    if (named > kNamedMicrobatches) continue;
    absl::StrAppend(&list, list.empty() ? "" : ", ", "(client '", h.client_id(), "', sequence ",
                    h.sequence(), ")");
  }
  std::string what;
  if (!computed.empty()) absl::StrAppend(&what, "; answered, not delivered: ", computed);
  if (!started.empty()) absl::StrAppend(&what, "; started, its answer dropped: ", started);
  if (!dropped.empty()) absl::StrAppend(&what, "; not computed: ", dropped);
  grpc::Status status(
      grpc::StatusCode::ABORTED,
      absl::StrCat(
          "answers on this Step stream were not read for ", absl::ToDoubleSeconds(waited),
          " s (--step_unread_timeout=", absl::FormatDuration(ctx_->admission->unread_timeout()),
          "): the call was ended and its admissions released", what,
          ". A micro-batch that was computed is counted once: sent again with the same client id "
          "and sequence it is answered as replayed and not counted again (one without a client "
          "id cannot be)"));
  end_status_ = status;
  cancelled_ = true;
  assembler_.Clear();
  ReleaseOpenLocked();
  DropUnstartedLocked();
  for (const std::shared_ptr<Slot>& slot : slots_) ReleaseSlotLocked(*slot);
  ctx_->metrics->UnreadAnswerAbort();
  return status;
}

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

void StepReactor::OnWriteDone(bool ok) {
  std::optional<StepTraceRecord> traced;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      read_closed_ = true;
      if (!finished_) {
        pending_finish_ =
            end_status_.value_or(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      }
    } else {
      Slot& slot = *slots_.front();
      ++slot.next;
      if (slot.next == slot.responses.size()) {
        if (slot.head_known) {
          ctx_->metrics->StepPhase(slot.assembled.microbatch.header.head(), "send",
                                   absl::Now() - slot.first_send);
        }
        if (ctx_->step_trace != nullptr) traced = TraceRecord(slot);
        ReleaseSlotLocked(slot);
        slots_.pop_front();
        --inflight_;
        ctx_->metrics->InflightAdd(-1);
      }
    }
  }
  // Outside mu_: the write may wait for other streams' lines.
  if (traced.has_value()) ctx_->step_trace->Write(*traced);
  Pump();
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

void StepReactor::OnDone() {
  ctx_->streams.Remove(this);
  bool destroy;
  grpc::Alarm* pending_alarms[kTimers] = {nullptr, nullptr};
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    ctx_->metrics->RpcFinished("Step", final_status_.error_code(), absl::Now() - start_);
    ctx_->metrics->InflightAdd(-inflight_);
    inflight_ = 0;
    ReleaseOpenLocked();
    for (const std::shared_ptr<Slot>& slot : slots_) ReleaseSlotLocked(*slot);
    // The call is finished, so nothing re-arms the alarms now; cancelling them makes their
    // callbacks run (and unpin) at once instead of after the timeout. Pinned across the calls,
    // outside mu_.
    for (int timer = 0; timer < kTimers; ++timer) {
      if (alarm_pending_[timer]) pending_alarms[timer] = alarms_[timer].get();
    }
    if (pending_alarms[kStall] != nullptr || pending_alarms[kUnread] != nullptr) ++pins_;
    destroy = pins_ == 0;
  }
  if (pending_alarms[kStall] != nullptr || pending_alarms[kUnread] != nullptr) {
    for (grpc::Alarm* alarm : pending_alarms) {
      if (alarm != nullptr) alarm->Cancel();
    }
    Unpin();
    return;
  }
  if (destroy) delete this;
}

void StepReactor::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    assembler_.Clear();
    ReleaseOpenLocked();
    DropUnstartedLocked();
  }
  Pump();
}

void StepReactor::DropUnstartedLocked() {
  // A computing one finishes (it cannot be interrupted) and its answer's write fails.
  for (auto it = slots_.begin(); it != slots_.end();) {
    Slot& slot = **it;
    if (slot.started) {
      ++it;
      continue;
    }
    ReleaseSlotLocked(slot);
    --inflight_;
    ctx_->metrics->InflightAdd(-1);
    it = slots_.erase(it);
  }
}

grpc::Status StepReactor::CancelStatus() const {
  if (call_ != nullptr && absl::FromChrono(call_->deadline()) <= absl::Now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the Step call's deadline passed");
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the Step call was cancelled");
}

absl::Status StepReactor::AdmitHeaderLocked(const StepMessage& message) {
  const v1::StepHeader& header = message.request.header();
  const size_t piece = message.bytes();
  open_received_ = piece;
  open_announced_ = 0;
  // What can never be served is refused before any of its data is read, and without a retry
  // hint even when the server is busy, so that nobody is invited to send it again. First the
  // stream's token: streams live long (clients keep them between steps) and a reload may have
  // revoked it since the call was authorised.
  if (call_ != nullptr) {
    if (absl::Status auth = AuthorizeOpenCall(ctx_->tokens, "/losshead.v1.LossHead/Step",
                                              call_->client_metadata());
        !auth.ok()) {
      return auth;
    }
  }
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(header.head());
  if (!head.ok()) return head.status();
  const uint64_t announced = AnnouncedBytes(header, (*head)->hidden_size());
  if (announced > ctx_->max_microbatch_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "micro-batch of ", announced, " bytes (as its header announces) exceeds the limit of ",
        ctx_->max_microbatch_bytes, " bytes (--max_microbatch_bytes)"));
  }
  if (absl::Status checked = (*head)->CheckHeader(header); !checked.ok()) return checked;
  open_announced_ = announced;
  Admission* admission = ctx_->admission;
  if (admission == nullptr) return absl::OkStatus();
  if (piece > ctx_->max_microbatch_bytes) return absl::OkStatus();  // refused as oversize
  // Reserve what the header announces (capped by the per-micro-batch limit, beyond which the
  // micro-batch is refused anyway), so that a large micro-batch is refused at its first
  // message rather than after much of it has been buffered; and room for its answer, which
  // takes the request's place once computed (more only where dH is asked for in a wider dtype;
  // never more than the whole bound, so that it can always be admitted).
  const uint64_t answer =
      std::min<uint64_t>(AnswerBytes(header, (*head)->hidden_size()), admission->max_bytes());
  const size_t want =
      std::max({static_cast<size_t>(announced), static_cast<size_t>(answer), piece});
  if (!admission->TryAdmit(want)) {
    return admission->Refusal(absl::StrCat("no room to admit a micro-batch of ", want, " bytes"));
  }
  open_admitted_ = true;
  open_reserved_ = want;
  return absl::OkStatus();
}

absl::Status StepReactor::AdmitPieceLocked(const StepMessage& message) {
  Admission* admission = ctx_->admission;
  const size_t piece = message.bytes();
  if (!assembler_.open() || !assembler_.buffering()) return absl::OkStatus();
  open_received_ += piece;
  // Past the per-micro-batch limit the assembler stops buffering and refuses it permanently.
  if (open_received_ > ctx_->max_microbatch_bytes) return absl::OkStatus();
  if (admission == nullptr || !open_admitted_ || open_received_ <= open_reserved_) {
    return absl::OkStatus();
  }
  const size_t more = open_received_ - open_reserved_;
  if (!admission->TryReserve(more)) {
    ReleaseOpenLocked();
    return admission->Refusal(absl::StrCat("no room to buffer ", more, " more bytes"));
  }
  open_reserved_ += more;
  return absl::OkStatus();
}

void StepReactor::ReleaseOpenLocked() {
  if (ctx_->admission != nullptr && (open_admitted_ || open_reserved_ > 0)) {
    ctx_->admission->Release(open_admitted_ ? 1 : 0, open_reserved_);
  }
  open_admitted_ = false;
  open_reserved_ = 0;
}

void StepReactor::ReleaseSlotBytesLocked(Slot& slot) {
  if (ctx_->admission != nullptr && slot.reserved > 0) ctx_->admission->Release(0, slot.reserved);
  slot.reserved = 0;
}

void StepReactor::ReleaseSlotLocked(Slot& slot) {
  ReleaseSlotBytesLocked(slot);
  if (ctx_->admission != nullptr && slot.admitted) ctx_->admission->Release(1, 0);
  slot.admitted = false;
}

void StepReactor::BookAnswerLocked(Slot& slot, size_t bytes) {
  if (ctx_->admission == nullptr || !slot.admitted || cancelled_ || finished_) {
    ReleaseSlotBytesLocked(slot);
    return;
  }
  ctx_->admission->Replace(slot.reserved, bytes);
  slot.reserved = bytes;
}

void StepReactor::Unpin() {
  bool destroy;
  {
    absl::MutexLock lock(&mu_);
    --pins_;
    destroy = done_ && pins_ == 0;
  }
  if (destroy) delete this;
}

}  // namespace losshead::server
