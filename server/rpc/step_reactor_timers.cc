// The Step stream's two timers (step_reactor.h): the stall clock of the micro-batch being
// received, and the unread clock of the pending response write.
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "server/rpc/step_reactor.h"

namespace losshead::server {
namespace {

// The micro-batches an unread-answer status names at most (a stream holds
// --max_inflight_per_stream of them).
constexpr size_t kNamedMicrobatches = 16;

}  // namespace

void StepReactor::ArmStallLocked(absl::Time now) {
  const absl::Duration stall =
      ctx_->admission != nullptr ? ctx_->admission->stall_timeout() : absl::InfiniteDuration();
  // One alarm at a time covers every micro-batch of the stream: it re-arms while one is open.
  if (assembler_.open() && !alarm_pending_[kStall] && stall != absl::InfiniteDuration()) {
    ArmAlarmLocked(kStall, now + (stall - stall_waited_));
  }
}

void StepReactor::ArmUnreadLocked() {
  const absl::Duration unread =
      ctx_->admission != nullptr ? ctx_->admission->unread_timeout() : absl::InfiniteDuration();
  if (!alarm_pending_[kUnread] && unread != absl::InfiniteDuration()) {
    ArmAlarmLocked(kUnread, write_started_ + unread);
  }
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
        AbandonStalledLocked(waited, timeout);
        stalled = true;
      } else {
        ArmAlarmLocked(kStall, now + (timeout - waited));
      }
    }
  }
  if (stalled) Pump();
  Unpin();
}

void StepReactor::AbandonStalledLocked(absl::Duration waited, absl::Duration timeout) {
  const v1::StepHeader& h = assembler_.open_header();
  end_status_ = grpc::Status(
      grpc::StatusCode::ABORTED,
      absl::StrCat("micro-batch (head '", h.head(), "', client '", h.client_id(), "', sequence ",
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
  // Named before anything is dropped.
  const std::string what = UndeliveredLocked();
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

std::string StepReactor::UndeliveredLocked() const {
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
  return what;
}

}  // namespace losshead::server
