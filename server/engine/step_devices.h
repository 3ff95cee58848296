// The devices one micro-batch runs on, with what it holds of each for as long as it lives: its
// tokens queued there (ReplicaGroup::Next's measure, and what keeps the idle flush away), an I/O
// slot, and, once its run is prepared, the workspace bytes it uses and where its part of dW goes.
// Filled by the placement (Placement::Take), used by the step pipeline; one per micro-batch, on
// the stack of the thread that runs it.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_DEVICES_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_DEVICES_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "losshead/kernels/backend.h"
#include "server/engine/replica_group.h"

namespace losshead::server {

class StepDevices {
 public:
  StepDevices() = default;
  // Lands a launched run (Landed), gives the slots back and takes the tokens off the queues
  // (where ReleaseQueued has not).
  ~StepDevices();
  StepDevices(const StepDevices&) = delete;
  StepDevices& operator=(const StepDevices&) = delete;

  // Adds `replica`, the next device in ascending rank, with `tokens` (the same on every device of
  // the micro-batch) queued there from now on. Before TakeSlots.
  void Queue(Replica& replica, int64_t tokens);
  // An I/O slot of each device, taken in rank order (so that two micro-batches waiting for slots
  // never deadlock), each waiting for a free one.
  void TakeSlots();
  // The run is through: its tokens no longer count as queued on its devices.
  void ReleaseQueued();

  size_t size() const { return replicas_.size(); }
  // The devices in rank order (what ReplicaGroup::DeviceLocks takes); device 0 returns results.
  std::span<Replica* const> replicas() const { return replicas_; }
  Replica& replica(size_t i) const { return *replicas_[i]; }
  IoSlot& slot(size_t i) const { return *parts_[i].slot; }
  // Set by Placement::Run's preparation, under the devices' compute locks.
  kernels::GradStash& stash(size_t i) { return parts_[i].stash; }
  size_t& workspace_bytes(size_t i) { return parts_[i].workspace_bytes; }

  // Waits for every device's stream; the first error.
  absl::Status Synchronize() const;
  // Under the devices' compute locks, after a run was launched: marks its work on every device's
  // stream and counts it in flight there (Replica::runs_in_flight), so that the locks can go to
  // the next micro-batch, whose run then waits on the streams behind this one's, before it is
  // done. Nothing is in flight when this fails.
  absl::Status Launched();
  // Without the locks: waits for the work Launched marked (not the runs launched since); the
  // first error.
  absl::Status AwaitLaunched();
  // The run is done and counted: no longer in flight, a Cut waiting for it goes on. Called once
  // after a successful Launched, whatever AwaitLaunched answered; the destructor calls it
  // otherwise.
  void Landed();
  // Under the devices' compute locks, once a run of `tokens` on them is launched (`launched`:
  // without an error so far): the rows each stashed count in its stash, those of a run that
  // failed before it was launched being left out of dW, and the idle flush's clock starts again.
  void EndRun(int64_t tokens, bool launched);

 private:
  struct Part {
    std::unique_ptr<IoSlot> slot;
    kernels::GradStash stash;
    size_t workspace_bytes = 0;
  };
  std::vector<Replica*> replicas_;
  std::vector<Part> parts_;
  std::vector<std::unique_ptr<kernels::StreamMark>> launched_;  // one per device while in flight
  int64_t queued_ = 0;  // tokens queued on each device until ReleaseQueued
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_DEVICES_H_
