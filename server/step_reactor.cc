#include "server/step_reactor.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/status_util.h"

namespace losshead::server {

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

StepReactor::StepReactor(ServiceContext* ctx)
    : ctx_(ctx), start_(absl::Now()), assembler_(ctx->max_microbatch_bytes) {
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
  const v1::StepResponse* write = nullptr;
  bool read = false;
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (pending_finish_.has_value()) {
      finish = std::move(pending_finish_);
      pending_finish_.reset();
    } else {
      if (!writing_ && !slots_.empty() && slots_.front()->done) {
        Slot& slot = *slots_.front();
        if (slot.next == 0) slot.first_send = absl::Now();
        write = &slot.responses[slot.next];
        writing_ = true;
      }
      if (!reading_ && !read_closed_ && !draining_ &&
          slots_.size() < ctx_->max_inflight_per_stream) {
        reading_ = true;
        read = true;
      }
      if (!writing_ && slots_.empty() && (read_closed_ || draining_)) {
        finish = read_closed_ ? grpc::Status::OK
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
  if (read) StartRead(&request_);
  if (finish.has_value()) Finish(*finish);
}

void StepReactor::OnReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ok) {
      read_closed_ = true;
      if (assembler_.open() && !finished_) {
        pending_finish_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                       "malformed Step stream: it ended inside a micro-batch");
      }
    } else if (!finished_) {
      ctx_->metrics->Bytes("Step", "in", request_.hidden().size() + request_.targets().size());
      auto assembled = assembler_.Add(request_, absl::Now());
      request_.Clear();
      if (!assembled.ok()) {
        pending_finish_ = ToGrpcStatus(assembled.status());
      } else if (assembled->has_value()) {
        auto slot = std::make_shared<Slot>();
        slot->assembled = std::move(**assembled);
        slot->ready = absl::Now();
        slots_.push_back(std::move(slot));
        ++inflight_;
        ctx_->metrics->InflightAdd(1);
        StartNextSlotLocked();
      }
    }
  }
  Pump();
}

void StepReactor::StartNextSlotLocked() {
  if (computing_ || finished_) return;
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
  if (slot->assembled.oversize) {
    outcome = absl::ResourceExhaustedError(absl::StrCat(
        "micro-batch of ", slot->assembled.received_bytes, " bytes exceeds the limit of ",
        ctx_->max_microbatch_bytes, " bytes (--max_microbatch_bytes)"));
  } else {
    absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(head_name);
    if (!head.ok()) {
      outcome = head.status();
    } else {
      known_head = true;
      outcome = (*head)->Step(mb, &stats);
    }
  }
  Metrics& m = *ctx_->metrics;
  if (known_head) {
    // Only existing heads get labelled series: a typo must not mint a new time series.
    m.StepPhase(head_name, "receive", slot->assembled.last_message - slot->assembled.first_message);
    m.StepPhase(head_name, "queue", (picked - slot->ready) + stats.queue);
    if (outcome.ok() && !stats.replayed) m.StepPhase(head_name, "compute", stats.compute);
    if (!outcome.ok()) {
      m.Microbatch(head_name, "error", static_cast<int>(outcome.status().code()));
    } else if (stats.replayed) {
      m.Microbatch(head_name, "replayed");
    } else {
      m.Microbatch(head_name, "ok");
      m.Tokens(head_name, (*outcome)->token_count);
    }
  } else {
    m.Failure("Step", static_cast<int>(outcome.status().code()));
  }
  if (outcome.ok()) {
    m.Bytes("Step", "out", (*outcome)->grad_hidden.size() + (*outcome)->per_token_loss.size());
  }
  std::vector<v1::StepResponse> responses = BuildStepResponses(
      mb.header, outcome, stats.replayed, ChunkPayloadBytes(ctx_->max_message_bytes));
  {
    absl::MutexLock lock(&mu_);
    slot->responses = std::move(responses);
    slot->done = true;
    slot->head_known = known_head;
    // The request's tensors are no longer needed; free them before the responses drain.
    std::string().swap(slot->assembled.microbatch.hidden);
    std::string().swap(slot->assembled.microbatch.targets);
    computing_ = false;
    StartNextSlotLocked();
  }
  Pump();
  Unpin();
}

void StepReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      read_closed_ = true;
      if (!finished_) {
        pending_finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
    } else {
      Slot& slot = *slots_.front();
      ++slot.next;
      if (slot.next == slot.responses.size()) {
        if (slot.head_known) {
          ctx_->metrics->StepPhase(slot.assembled.microbatch.header.head(), "send",
                                   absl::Now() - slot.first_send);
        }
        slots_.pop_front();
        --inflight_;
        ctx_->metrics->InflightAdd(-1);
      }
    }
  }
  Pump();
}

void StepReactor::OnDone() {
  ctx_->streams.Remove(this);
  bool destroy;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    ctx_->metrics->RpcFinished("Step", final_status_.error_code(), absl::Now() - start_);
    ctx_->metrics->InflightAdd(-inflight_);
    inflight_ = 0;
    destroy = pins_ == 0;
  }
  if (destroy) delete this;
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
