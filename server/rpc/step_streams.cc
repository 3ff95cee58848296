// StepStreams (service_context.h): the live Step streams, for shutdown.
#include <vector>

#include "server/rpc/service_context.h"
#include "server/rpc/step_reactor.h"

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

}  // namespace losshead::server
