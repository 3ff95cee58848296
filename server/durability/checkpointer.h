// Writes and restores the checkpoints of a server's heads in one directory: <head>.lhck per head
// (format: server/durability/checkpoint.h). Writes happen on demand (the Checkpoint RPC),
// periodically, and at shutdown; they are serialised, each head's snapshot is consistent on its own
// (heads are not cut together). Thread-safe.
//
// Named snapshots live beside them, snapshots/<tag>/<head>.lhck in the same format: written on
// demand only, never restored at start, put back into a live head by RestoreSnapshot, and left
// alone by DeleteHead (they belong to the training run that named them, which prunes them).
// Every write, restore and removal holds one lock, so a restore's swap and its new <head>.lhck
// never interleave with a periodic write of the head it replaces.
#ifndef LOSSHEAD_SERVER_DURABILITY_CHECKPOINTER_H_
#define LOSSHEAD_SERVER_DURABILITY_CHECKPOINTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"

namespace losshead::server {

// One head's checkpoint file written, failed, or restored (at start, or from a named snapshot,
// which becomes its checkpoint): what operators watch (the age, duration, size and failures of
// checkpoints; server.cc turns it into metrics).
struct CheckpointEvent {
  enum class Kind { kWritten, kFailed, kRestored };
  Kind kind = Kind::kWritten;
  std::string head;
  uint64_t bytes = 0;                              // the file's size (kWritten, kRestored)
  absl::Duration duration = absl::ZeroDuration();  // snapshot + write + fsync, or read + restore
  // When the head's state reached the disk: the end of the write, a file restored at start's
  // modification time (a restored head is exactly as old as its file), or the moment a snapshot
  // became the head's checkpoint.
  absl::Time persisted_at = absl::InfinitePast();
  absl::Status error;  // kFailed
};
// Called on the writing thread after each event; must not call back into the Checkpointer.
using CheckpointObserver = std::function<void(const CheckpointEvent&)>;

class Checkpointer {
 public:
  Checkpointer(std::string dir, HeadRegistry* registry, CheckpointObserver observer = nullptr)
      : dir_(std::move(dir)), registry_(registry), observer_(std::move(observer)) {}
  ~Checkpointer();  // StopPeriodic()

  // At start, before serving: creates the directory if needed, deletes temporary files left by a
  // write that a crash interrupted (snapshots' too), and restores every <head>.lhck into the
  // registry (never a snapshot). Any file
  // that cannot be restored fails the whole restore with an error naming it (DATA_LOSS for a
  // corrupt or torn file): a server must not start with part of its state silently missing.
  // Each head goes on the devices the registry places its saved placement on (all of them where
  // it asks for more than the server now has: the file fits any placement).
  absl::Status RestoreAll();

  // Writes `head`'s checkpoint, or every head's when empty (NOT_FOUND for an unknown head). A
  // head deleted meanwhile is skipped, never resurrected on disk.
  absl::StatusOr<v1::CheckpointResponse> Write(const std::string& head);

  // Deletes `head` from the registry, then its checkpoint file, with no write in between: a head
  // of the same name created meanwhile cannot be checkpointed before the old file is gone, so the
  // file removed is never the new head's.
  absl::Status DeleteHead(const std::string& head);

  // Writes every head each `interval` on a thread of its own until StopPeriodic; errors are
  // logged and retried at the next tick.
  void StartPeriodic(absl::Duration interval);
  void StopPeriodic();

  std::string PathOf(const std::string& head) const;
  const std::string& dir() const { return dir_; }

  // A snapshot tag's syntax: [A-Za-z0-9._-]{1,128}, not starting with '.' (INVALID_ARGUMENT).
  static absl::Status ValidateTag(const std::string& tag);
  std::string SnapshotPath(const std::string& head, const std::string& tag) const;

  // Writes `head`'s consistent cut (Head::Snapshot) to SnapshotPath, atomically, replacing a
  // snapshot of that tag. Nothing else changes: <head>.lhck and the head's persisted sequences
  // stay as they were. INVALID_ARGUMENT for a bad tag or head name, NOT_FOUND for an unknown head.
  absl::StatusOr<v1::SnapshotInfo> WriteSnapshot(const std::string& head, const std::string& tag);
  // Replaces the head (or adds it) with the state of its snapshot `tag`, through
  // HeadRegistry::Restore; the commit makes the snapshot the head's <head>.lhck first (a hard link
  // of the file where the file system has them, else a write), so that a restart comes back to
  // the restored state, which is then persisted. NOT_FOUND for a missing snapshot, DATA_LOSS for
  // a corrupt one or one of another head; the registry's errors; on any error nothing changed.
  absl::StatusOr<std::shared_ptr<Head>> RestoreSnapshot(const std::string& head,
                                                        const std::string& tag);
  // Removes the snapshot (and its tag's directory once empty); NOT_FOUND when there is none.
  absl::Status DeleteSnapshot(const std::string& head, const std::string& tag);
  // The snapshots of `head` by tag, from their files' headers (ReadCheckpointMeta: unverified);
  // a file whose header does not parse is listed with version and step 0. The head need not
  // exist.
  absl::StatusOr<std::vector<v1::SnapshotInfo>> ListSnapshots(const std::string& head);

 private:
  absl::StatusOr<v1::HeadCheckpoint> WriteLocked(const std::shared_ptr<Head>& head)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_ (RestoreSnapshot's commit): makes the snapshot file at `snapshot` (holding `data`)
  // the checkpoint of data's head.
  absl::Status AdoptSnapshot(const std::string& snapshot, const HeadCheckpointData& data);
  // At start: deletes the temporary files of snapshot writes that a crash interrupted.
  absl::Status RemoveSnapshotTemporaries();
  void Report(const CheckpointEvent& event) const {
    if (observer_) observer_(event);
  }

  const std::string dir_;
  HeadRegistry* const registry_;
  const CheckpointObserver observer_;
  absl::Mutex mu_;  // one write (or removal) at a time

  std::unique_ptr<absl::Notification> stop_;
  std::thread periodic_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_DURABILITY_CHECKPOINTER_H_
