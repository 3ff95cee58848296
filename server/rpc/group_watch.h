// Watches a process group for a broken member, for a group that can be rebuilt from checkpoints
// (docs/multi-process.md, "Recovery"): a group is never repaired in place, so a process whose
// group broke has nothing left to serve but UNAVAILABLE, and the recovery is a restart of every
// process from the last complete checkpoint set. The watch finds the break within about
// `interval` plus `timeout` even when no cut runs (a cut finds it too): every `interval` it reads
// the group's health and probes every peer (GroupControl::Probe). A peer that has not answered
// yet (it may still be restoring its part) has `first_answer` from the watch's start to answer
// once; after that one failed probe is a break. On a break `on_broken` is called once, with the
// reason, on the watch's thread (the server ends the process there).
#ifndef LOSSHEAD_SERVER_RPC_GROUP_WATCH_H_
#define LOSSHEAD_SERVER_RPC_GROUP_WATCH_H_

#include <functional>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/rpc/group_control.h"

namespace losshead::server {

class GroupWatch {
 public:
  GroupWatch(GroupControl* group, absl::Duration interval, absl::Duration timeout,
             absl::Duration first_answer, std::function<void(const absl::Status&)> on_broken);
  ~GroupWatch();  // stops the watch (a server shutting down stops it before it drains)

 private:
  void Run();

  GroupControl* const group_;
  const absl::Duration interval_;
  const absl::Duration timeout_;
  const absl::Duration first_answer_;
  const std::function<void(const absl::Status&)> on_broken_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_GROUP_WATCH_H_
