// Checkpoints of the heads of a process group (docs/multi-process.md, "Checkpoints across
// processes"): one global cut per set, each process writing its part into its own
// --checkpoint_dir (hosts share no disks), the leader (process 0) writing the set's manifest last.
//
// Layout of one process's directory:
//   sets/<cut, 20 digits>/<head>.lhck  this process's part: every head, in the one-process format
//                                      (checkpoint.h), written by the one-process writer; a
//                                      head sharded across processes: this process's rows only
//                                      (Head::SnapshotPart, format 7's rows record)
//   sets/<cut>/MANIFEST                the leader's: the set's CheckpointManifest (every part's
//                                      files with their sizes and digests), written after every
//                                      process reported its part written
//   sets/<cut>/COMMITTED               a follower's: the leader told it the manifest is written
// A set exists only if the leader's MANIFEST does; COMMITTED tells a follower which of its parts
// belong to complete sets (for pruning and for the start's check), never makes a set complete.
//
// Invariants: cuts increase (the leader numbers them from the cut it restored); a part's files
// are fsynced before the process reports it written, the manifest and markers are written
// atomically; "persisted" (GetClientProgress) moves to a part's cut only once its set is complete
// here (Complete/Commit), never when only the part is written. Pruning keeps the newest kKeepSets
// complete sets and every set newer than the oldest of them (a set in flight, or one whose commit
// did not arrive), and removes the rest. At start, sets newer than the agreed cut are removed:
// they never completed, and their numbers will be used again.
//
// Thread-safe (one write at a time).
#ifndef LOSSHEAD_SERVER_DURABILITY_GROUP_CHECKPOINT_H_
#define LOSSHEAD_SERVER_DURABILITY_GROUP_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "losshead/kernels/process_group.h"
#include "losshead/v1/process_control.pb.h"
#include "server/durability/checkpointer.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"

namespace losshead::server {

// How many complete sets each process keeps.
inline constexpr int kKeepSets = 3;
inline constexpr char kManifestFile[] = "MANIFEST";
inline constexpr char kCommittedFile[] = "COMMITTED";

class CheckpointSets {
 public:
  CheckpointSets(std::string dir, int rank, int processes, HeadRegistry* registry,
                 CheckpointObserver observer = nullptr, int keep = kKeepSets);

  int rank() const { return rank_; }
  std::string SetDir(uint64_t cut) const;

  // Start (before serving). The newest cut this process knows complete: the leader's newest with
  // a MANIFEST, a follower's newest with COMMITTED; 0 for none. Creates the directory.
  absl::StatusOr<uint64_t> NewestComplete();
  // The leader's manifest of `cut` (NOT_FOUND, DATA_LOSS naming the file).
  absl::StatusOr<v1::CheckpointManifest> ReadManifest(uint64_t cut);
  // This process's part of `manifest` is in place: the set's directory holds exactly the files
  // the manifest lists for this rank, each of the listed size and digest. NOT_FOUND for a missing
  // directory or file, DATA_LOSS for one of another size or digest, an extra one, or a manifest
  // of another group size or without this rank.
  absl::Status CheckPart(const v1::CheckpointManifest& manifest);
  // After CheckPart: each file of this process's part that holds a head sharded across processes
  // holds the rows this process owns here (CheckPartRows, from the file's meta alone, against the
  // group size, this rank and the devices its placement gets): FAILED_PRECONDITION or DATA_LOSS
  // naming the file otherwise.
  absl::Status CheckRows(const v1::CheckpointManifest& manifest);
  // Every head of this process's part of `cut` into the registry (Checkpointer::RestoreAll over
  // the set's directory): its errors.
  absl::Status Restore(uint64_t cut);
  // Once every process agreed on `cut` (0: none): removes the sets newer than it, records it
  // complete here (a follower whose COMMITTED did not arrive), prunes.
  absl::Status Settle(uint64_t cut);

  // Running. Writes this process's part of `cut` (each head's consistent cut, one file per head,
  // fsynced): the part and what the Checkpoint RPC answers for it.
  absl::StatusOr<std::pair<v1::CheckpointPart, v1::CheckpointResponse>> WritePart(uint64_t cut);
  // The leader: writes the set's manifest, which makes it complete; then commits it here.
  absl::Status WriteManifest(const v1::CheckpointManifest& manifest);
  // A follower: the leader wrote the manifest of `cut`.
  absl::Status Commit(uint64_t cut);
  // The set of `cut` will not complete (a process failed): forgets its part's progress.
  void Abandon(uint64_t cut);

 private:
  // Sets present in sets/, by cut, and whether each is complete here.
  absl::StatusOr<std::map<uint64_t, bool>> ListLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The part's progress becomes persisted; older pending parts are dropped; prunes.
  absl::Status CompleteLocked(uint64_t cut) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  const int rank_;
  const int processes_;
  HeadRegistry* const registry_;
  const CheckpointObserver observer_;
  const int keep_;
  absl::Mutex mu_;
  // Parts written whose sets are not complete yet: each head with its clients' progress at the
  // cut (tensors dropped), marked persisted when the set completes.
  std::map<uint64_t, std::vector<std::pair<std::shared_ptr<Head>, HeadCheckpointData>>> pending_
      ABSL_GUARDED_BY(mu_);
};

// At start, right after the group formed (a collective exchange, every process calls it): OK when
// every process has checkpoints `enabled` alike; FAILED_PRECONDITION naming a process of each kind
// otherwise (the restore and every set need all of them).
absl::Status AgreeOnCheckpoints(kernels::ProcessGroup& group, bool enabled);

// At start, after the group formed and before serving: the processes agree on one set and each
// restores its part of it (a sequence of collective exchanges over `group`: every process calls
// it once). The leader names its newest set with a manifest and hands the manifest out; each
// process checks its part (CheckPart, CheckRows), every process learns every check's verdict, and
// only if all passed each restores its part (a head sharded across processes is restored by every
// process together); then every process learns every verdict.
// Any process failing (its part missing or damaged, or a complete set newer than the leader's
// newest: FAILED_PRECONDITION, the leader's directory is not the one it wrote) fails the start on
// every process with that process's code and reason. Returns the agreed cut (0: none, nothing
// restored); on success every process Settled it.
absl::StatusOr<uint64_t> RestoreAgreedSet(kernels::ProcessGroup& group, CheckpointSets& sets);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_DURABILITY_GROUP_CHECKPOINT_H_
