// The final checkpoint set of a group stopping in order (group_control.h, Leave): each process,
// its clients drained, tells the leader it is stopping; the leader takes one last set once every
// process is, and answers them all with its outcome. A process stopping alone waits for the others
// until its deadline and leaves without a set: its group breaks (the others' watches end them),
// and the restart comes back to the last complete set, as after a failure.
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/rpc/group_control.h"

namespace losshead::server {

absl::Status GroupControl::Leave(absl::Time deadline) {
  if (leader()) return AwaitFinalSet(rank(), deadline);
  v1::ControlRequest request;
  request.set_origin(rank());
  request.mutable_leaving()->set_rank(rank());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  Authenticate(context, "");
  v1::ControlResponse response;
  const grpc::Status status = StubOf(0).Lead(&context, request, &response);
  if (status.ok()) return absl::OkStatus();
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(
        "not every process of the group stopped before this one's deadline");
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("the group's leader (process 0 at ", addresses_[0],
                                   "): ", status.error_message()));
}

absl::Status GroupControl::AwaitFinalSet(int process, absl::Time deadline) {
  if (sets_ == nullptr) {
    return absl::FailedPreconditionError("checkpoints are disabled (no --checkpoint_dir)");
  }
  bool take = false;
  {
    absl::MutexLock lock(&leave_mu_);
    if (leaving_.empty()) leaving_.assign(size(), false);
    if (process >= 0 && process < size()) leaving_[process] = true;
    bool all = true;
    for (bool stopping : leaving_) all = all && stopping;
    if (all && !final_started_) final_started_ = take = true;
  }
  if (take) {
    // Every process has drained its clients: the set holds every micro-batch answered anywhere.
    // Nothing else is led any more, but the leader's order is kept all the same.
    absl::Status taken;
    {
      absl::MutexLock lock(&lead_mu_);
      taken = window_->health();
      if (taken.ok()) {
        v1::ControlRequest set;
        set.set_sequence(++sequence_);
        set.set_origin(rank());
        set.mutable_checkpoint();
        taken = LeadCheckpoint(std::move(set), /*authorization=*/"").status();
      }
    }
    absl::MutexLock lock(&leave_mu_);
    final_ = taken;
    final_done_ = true;
    return taken;
  }
  absl::MutexLock lock(&leave_mu_);
  leave_mu_.AwaitWithDeadline(absl::Condition(&final_done_), deadline);
  if (final_done_) return final_;
  return absl::DeadlineExceededError("not every process of the group stopped before the deadline");
}

}  // namespace losshead::server
