#include "server/engine/step_devices.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace losshead::server {

StepDevices::~StepDevices() {
  Landed();
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (parts_[i].slot == nullptr) continue;
    Replica& r = *replicas_[i];
    absl::MutexLock lock(&r.slots_mu);
    r.free_slots.push_back(std::move(parts_[i].slot));
  }
  ReleaseQueued();
}

void StepDevices::Queue(Replica& replica, int64_t tokens) {
  replica.queued_tokens += tokens;
  queued_ = tokens;
  replicas_.push_back(&replica);
}

void StepDevices::TakeSlots() {
  parts_.resize(replicas_.size());
  for (size_t i = 0; i < replicas_.size(); ++i) {
    Replica& r = *replicas_[i];
    absl::MutexLock lock(&r.slots_mu);
    r.slots_mu.Await(absl::Condition(
        +[](std::vector<std::unique_ptr<IoSlot>>* free) { return !free->empty(); }, &r.free_slots));
    parts_[i].slot = std::move(r.free_slots.back());
    r.free_slots.pop_back();
  }
}

void StepDevices::ReleaseQueued() {
  for (Replica* r : replicas_) r->queued_tokens -= queued_;
  queued_ = 0;
}

absl::Status StepDevices::Synchronize() const {
  absl::Status first;
  for (Replica* r : replicas_) {
    if (r->stream != nullptr) first.Update(r->stream->Synchronize());
  }
  return first;
}

absl::Status StepDevices::Launched() {
  std::vector<std::unique_ptr<kernels::StreamMark>> marks;
  for (Replica* r : replicas_) {
    absl::StatusOr<std::unique_ptr<kernels::StreamMark>> mark = r->stream->Mark();
    if (!mark.ok()) return mark.status();
    marks.push_back(std::move(*mark));
  }
  for (Replica* r : replicas_) {
    absl::MutexLock flight(&r->flight_mu);
    ++r->runs_in_flight;
  }
  launched_ = std::move(marks);
  return absl::OkStatus();
}

absl::Status StepDevices::AwaitLaunched() {
  absl::Status first;
  for (const auto& mark : launched_) first.Update(mark->Wait());
  return first;
}

void StepDevices::Landed() {
  if (launched_.empty()) return;
  launched_.clear();
  for (Replica* r : replicas_) {
    absl::MutexLock flight(&r->flight_mu);
    --r->runs_in_flight;
  }
}

void StepDevices::EndRun(int64_t tokens, bool launched) {
  for (size_t i = 0; i < replicas_.size(); ++i) {
    Replica& r = *replicas_[i];
    if (launched && parts_[i].stash.data != nullptr) {
      r.stash_tokens += tokens;
      r.stashed_tokens = r.stash_tokens;
    }
    r.last_run_end_ns = absl::GetCurrentTimeNanos();
  }
}

}  // namespace losshead::server
