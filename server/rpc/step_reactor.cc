#include "server/rpc/step_reactor.h"

#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "server/rpc/status_util.h"

namespace losshead::server {
namespace {

// The `hidden` field of StepRequest (proto/losshead/v1/losshead.proto).
constexpr uint32_t kRequestHiddenField = 2;

}  // namespace

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
      // In this order: a write just started defers the finish.
      write = NextWriteLocked();
      read = NextReadLocked();
      finish = FinishStatusLocked();
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

const grpc::ByteBuffer* StepReactor::NextWriteLocked() {
  if (writing_ || slots_.empty() || !slots_.front()->done) return nullptr;
  Slot& slot = *slots_.front();
  write_started_ = absl::Now();  // the unread timer's only cost per response message
  if (slot.next == 0) slot.first_send = write_started_;
  writing_ = true;
  ArmUnreadLocked();
  return &slot.responses[slot.next];
}

bool StepReactor::NextReadLocked() {
  if (reading_ || read_closed_ || draining_ || cancelled_ || end_status_.has_value() ||
      slots_.size() >= ctx_->max_inflight_per_stream) {
    return false;
  }
  reading_ = true;
  read_started_ = absl::Now();  // the stall timer's only cost per message
  return true;
}

std::optional<grpc::Status> StepReactor::FinishStatusLocked() const {
  if (writing_ || !slots_.empty() ||
      !(read_closed_ || draining_ || cancelled_ || end_status_.has_value())) {
    return std::nullopt;
  }
  return end_status_.has_value() ? *end_status_
         : cancelled_            ? CancelStatus()
         : read_closed_          ? grpc::Status::OK
                                 : grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                "the server is shutting down; no further "
                                                "micro-batches are read on this stream");
}

void StepReactor::OnReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (ok) ok = ParseReadLocked();
    if (!ok) {
      CloseReadLocked();
    } else if (!finished_ && !cancelled_ && !end_status_.has_value()) {
      const absl::Time now = absl::Now();
      ctx_->metrics->Bytes("Step", "in", message_.bytes());
      ctx_->metrics->StepDataBytes("network", "in", message_.bytes());
      ReceiveLocked(message_, now);
      ArmStallLocked(now);
    }
    // After a stall or malformed input, whatever still arrives is dropped: the stream ends once
    // its earlier micro-batches are answered.
    message_.Clear();
    hidden_slices_ = {};
    read_buffer_.Clear();
  }
  Pump();
}

bool StepReactor::ParseReadLocked() {
  const bool parsed = transport::wire::ParseWithoutData(read_buffer_, kRequestHiddenField,
                                                        &message_.request, &hidden_slices_)
                          .ok();
  message_.hidden.swap(hidden_slices_.pieces);
  message_.hidden_bytes = hidden_slices_.size;
  if (!parsed) {
    EndLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                           "malformed Step stream: a message is not a StepRequest"));
  }
  return parsed;
}

void StepReactor::CloseReadLocked() {
  read_closed_ = true;
  if (assembler_.open()) {
    EndLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                           "malformed Step stream: it ended inside a micro-batch"));
  }
  // A partial micro-batch can never complete now: free its bytes at once.
  assembler_.Clear();
  ReleaseOpenLocked();
}

void StepReactor::ReceiveLocked(StepMessage& message, absl::Time now) {
  const bool opens = message.request.has_header() && !assembler_.open();
  // Admitted (and reserved) before anything is buffered.
  absl::Status admitted = opens ? AdmitHeaderLocked(message) : AdmitPieceLocked(message);
  if (opens && message.request.header().has_shared_memory()) {
    if (admitted.ok()) {
      admitted = ResolveSharedLocked(message);
    } else {
      message.request.mutable_header()->clear_shared_memory();  // refused: nothing is read
    }
  }
  // A micro-batch of several messages gets its buffer sized from the header, once; one whose
  // tensors stay in a device region gets its buffer when they are copied out.
  const size_t reserve = opens && admitted.ok() && message.region_bytes == 0 ? open_announced_ : 0;
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
  slot->shared = std::move(open_shared_);
  slot->input = std::move(open_input_);
  open_shared_ = {};
  open_input_ = {};
  slot->ready = now;
  if (slot->assembled.oversize || !slot->assembled.refused.ok()) {
    slot->input = {};  // answered with its refusal: nothing is copied
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
          RecordMicrobatchSent(*ctx_->metrics, slot.assembled.microbatch.header.head(),
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
