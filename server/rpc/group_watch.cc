#include "server/rpc/group_watch.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace losshead::server {

GroupWatch::GroupWatch(GroupControl* group, absl::Duration interval, absl::Duration timeout,
                       absl::Duration first_answer,
                       std::function<void(const absl::Status&)> on_broken)
    : group_(group),
      interval_(interval),
      timeout_(timeout),
      first_answer_(first_answer),
      on_broken_(std::move(on_broken)),
      thread_([this] { Run(); }) {}

GroupWatch::~GroupWatch() {
  stop_.Notify();
  thread_.join();
}

void GroupWatch::Run() {
  const absl::Time start = absl::Now();
  std::vector<bool> answered(group_->size(), false);
  while (!stop_.WaitForNotificationWithTimeout(interval_)) {
    absl::Status broken = group_->health();
    for (int p = 0; p < group_->size() && broken.ok(); ++p) {
      if (p == group_->rank()) continue;
      const absl::Status probe = group_->Probe(p, timeout_);
      if (probe.ok()) {
        answered[p] = true;
      } else if (answered[p]) {
        broken = probe;
      } else if (absl::Now() - start > first_answer_) {
        broken = absl::UnavailableError(
            absl::StrCat("never answered since the group formed: ", probe.message()));
      }
    }
    if (stop_.HasBeenNotified()) return;
    if (!broken.ok()) {
      on_broken_(broken);
      return;
    }
  }
}

}  // namespace losshead::server
