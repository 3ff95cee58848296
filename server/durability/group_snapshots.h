// Named snapshots of the heads of a process group (docs/multi-process.md, "Named snapshots across
// processes"): one global cut through the leader, each process writing its part of the head into
// its own --checkpoint_dir (hosts share no disks), the leader (process 0) writing the snapshot's
// manifest last. The sequencing and the agreement between processes are the control plane's
// (server/rpc/group_snapshot.cc); this class is one process's files.
//
// Layout of one process's directory:
//   group_snapshots/<tag>/<head>.lhck      this process's part: the head in the one-process
//                                          format (checkpoint.h), written by the one-process
//                                          writer from Head::SnapshotPart (a replicated head:
//                                          all of W, this process's window and clients; a head
//                                          sharded across processes: this process's rows only)
//   group_snapshots/<tag>/<head>.manifest  the leader's: the SnapshotManifest (every part's file
//                                          with its size and digest), written after every process
//                                          reported its part written
// Kept apart from the one-process snapshots (snapshots/<tag>/<head>.lhck) so that a part is never
// taken for a whole head's snapshot by a server started alone on the directory.
//
// Invariants: a snapshot exists only if the leader's manifest does (a take that failed leaves no
// manifest, whatever parts were written, and is never listed); a part's file is fsynced before its
// process reports it written, the manifest is written atomically; a deletion removes the manifest
// before any part, so that no snapshot is listed whose parts are going.
//
// Thread-safe (one change at a time; listings read manifests only).
#ifndef LOSSHEAD_SERVER_DURABILITY_GROUP_SNAPSHOTS_H_
#define LOSSHEAD_SERVER_DURABILITY_GROUP_SNAPSHOTS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "losshead/v1/losshead.pb.h"
#include "losshead/v1/process_control.pb.h"
#include "server/durability/checkpointer.h"
#include "server/engine/head_checkpoint.h"
#include "server/engine/head_registry.h"

namespace losshead::server {

inline constexpr char kGroupSnapshotsDir[] = "group_snapshots";
inline constexpr char kSnapshotManifestSuffix[] = ".manifest";

class GroupSnapshots {
 public:
  GroupSnapshots(std::string dir, int rank, int processes, HeadRegistry* registry,
                 CheckpointObserver observer = nullptr);

  int rank() const { return rank_; }
  std::string PartPath(const std::string& head, const std::string& tag) const;
  std::string ManifestPath(const std::string& head, const std::string& tag) const;

  // The leader's manifest of `head`'s snapshot `tag`: NOT_FOUND when there is none (the snapshot
  // does not exist), DATA_LOSS naming the file when it does not parse or is another's.
  absl::StatusOr<v1::SnapshotManifest> ReadManifest(const std::string& head,
                                                    const std::string& tag) const;
  // The leader's snapshots of `head` by tag, from their manifests (a manifest that does not parse
  // is left out: it describes no snapshot that can be restored).
  absl::StatusOr<std::vector<v1::SnapshotInfo>> List(const std::string& head) const;

  // Writes this process's part of `head`'s snapshot `tag` (Head::SnapshotPart), replacing a part
  // left by a take that failed: the part (its file's name, size and digest) and what it holds
  // (version, optimizer step, bytes). NOT_FOUND for an unknown head.
  absl::StatusOr<std::pair<v1::CheckpointPart, v1::SnapshotInfo>> WritePart(const std::string& head,
                                                                            const std::string& tag);
  // The leader, once every part is written: the snapshot exists from here on.
  absl::Status WriteManifest(const v1::SnapshotManifest& manifest);

  // This process's part of `manifest`, checked and read: NOT_FOUND when it is missing, DATA_LOSS
  // when it is not the file the manifest lists (size, digest), holds another head, or does not
  // decode; FAILED_PRECONDITION or DATA_LOSS when a part of a head sharded across processes holds
  // other rows than this process owns now (CheckPartRows). Messages name this process.
  absl::StatusOr<HeadCheckpointData> ReadPart(const v1::SnapshotManifest& manifest) const;
  // OK when this process's part of `manifest` is there (NOT_FOUND naming this process otherwise).
  absl::Status CheckPartPresent(const v1::SnapshotManifest& manifest) const;

  // The leader: removes the manifest (the snapshot no longer exists). NOT_FOUND when it is gone.
  absl::Status RemoveManifest(const std::string& head, const std::string& tag);
  // Removes this process's part, if any, and the tag's directory once empty.
  absl::Status RemovePart(const std::string& head, const std::string& tag);

 private:
  const v1::CheckpointPart* PartOf(const v1::SnapshotManifest& manifest) const;

  const std::string dir_;  // <checkpoint_dir>/group_snapshots
  const int rank_;
  const int processes_;
  HeadRegistry* const registry_;
  const CheckpointObserver observer_;
  mutable absl::Mutex mu_;  // one write or removal at a time
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_DURABILITY_GROUP_SNAPSHOTS_H_
