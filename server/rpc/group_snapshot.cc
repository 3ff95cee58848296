// Named snapshots of a head across the processes of a group (group_control.h; the files are
// server/durability/group_snapshots.h): one request through the leader each. A take, restore or
// delete runs on every process at once (RunEverywhere) in the leader's order, so that every part
// of a snapshot lies between the same two control requests (the global cut, as for a checkpoint
// set) and every process restores or deletes at the same point of that order.
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/durability/checkpointer.h"
#include "server/durability/group_snapshots.h"
#include "server/engine/head_registry.h"
#include "server/rpc/group_control.h"
#include "server/rpc/service_context.h"

namespace losshead::server {
namespace {

absl::Status NoCheckpoints() {
  return absl::FailedPreconditionError(
      "snapshots need checkpoints, which are disabled (no --checkpoint_dir)");
}

v1::ControlRequest SnapshotRequest(v1::SnapshotControl::Action action, const std::string& head,
                                   const std::string& tag) {
  v1::ControlRequest request;
  v1::SnapshotControl& op = *request.mutable_snapshot();
  op.set_action(action);
  op.set_head(head);
  op.set_tag(tag);
  return request;
}

// The first failure: this process's, then each follower's in rank order.
absl::Status FirstFailure(const absl::StatusOr<v1::ControlResponse>& mine,
                          const std::vector<absl::StatusOr<v1::ControlResponse>>& answers) {
  if (!mine.ok()) return mine.status();
  for (size_t p = 1; p < answers.size(); ++p) {
    if (!answers[p].ok()) return answers[p].status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::SnapshotInfo> GroupControl::TakeSnapshot(const std::string& head,
                                                            const std::string& tag,
                                                            const std::string& authorization) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  LOSSHEAD_ASSIGN_OR_RETURN(
      v1::ControlResponse response,
      Run(SnapshotRequest(v1::SnapshotControl::SNAPSHOT_TAKE, head, tag), authorization));
  return std::move(*response.mutable_snapshot());
}

absl::StatusOr<v1::HeadInfo> GroupControl::RestoreSnapshot(const std::string& head,
                                                           const std::string& tag,
                                                           const std::string& authorization) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  LOSSHEAD_ASSIGN_OR_RETURN(
      v1::ControlResponse response,
      Run(SnapshotRequest(v1::SnapshotControl::SNAPSHOT_RESTORE, head, tag), authorization));
  // This process's head: its window counters are its own (the leader answered with its own).
  absl::StatusOr<std::shared_ptr<Head>> restored = ctx_->registry->Get(head);
  if (restored.ok()) return (*restored)->Info();
  return std::move(*response.mutable_head());
}

absl::Status GroupControl::DeleteSnapshot(const std::string& head, const std::string& tag,
                                          const std::string& authorization) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  return Run(SnapshotRequest(v1::SnapshotControl::SNAPSHOT_DELETE, head, tag), authorization)
      .status();
}

absl::StatusOr<std::vector<v1::SnapshotInfo>> GroupControl::ListSnapshots(
    const std::string& head, const std::string& authorization) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  LOSSHEAD_ASSIGN_OR_RETURN(
      v1::ControlResponse response,
      Run(SnapshotRequest(v1::SnapshotControl::SNAPSHOT_LIST, head, ""), authorization));
  return std::vector<v1::SnapshotInfo>(response.snapshots().begin(), response.snapshots().end());
}

std::pair<absl::StatusOr<v1::ControlResponse>, std::vector<absl::StatusOr<v1::ControlResponse>>>
GroupControl::RunEverywhere(const v1::ControlRequest& request, const std::string& authorization) {
  absl::StatusOr<v1::ControlResponse> mine;
  std::thread local([&] { mine = RunHere(request, nullptr); });
  std::vector<absl::StatusOr<v1::ControlResponse>> answers =
      ApplyOnFollowers(request, authorization);
  local.join();
  return {std::move(mine), std::move(answers)};
}

absl::StatusOr<v1::ControlResponse> GroupControl::LeadSnapshot(v1::ControlRequest request,
                                                               const std::string& authorization) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  v1::SnapshotControl& op = *request.mutable_snapshot();
  const std::string head = op.head();
  const std::string tag = op.tag();
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateName(head));
  v1::ControlResponse response;
  response.set_sequence(request.sequence());
  if (op.action() == v1::SnapshotControl::SNAPSHOT_LIST) {
    // The leader's manifests are the snapshots: nothing to ask the followers.
    LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<v1::SnapshotInfo> listed, snapshots_->List(head));
    for (const v1::SnapshotInfo& info : listed) *response.add_snapshots() = info;
    return response;
  }
  LOSSHEAD_RETURN_IF_ERROR(Checkpointer::ValidateTag(tag));
  switch (op.action()) {
    case v1::SnapshotControl::SNAPSHOT_TAKE: {
      // The leader's checks stand for every process's: every process holds the head alike, and
      // the snapshot exists exactly where the leader's manifest does.
      LOSSHEAD_RETURN_IF_ERROR(ctx_->registry->Get(head).status());
      if (absl::Status existing = snapshots_->ReadManifest(head, tag).status();
          !absl::IsNotFound(existing)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "head '", head, "' has a snapshot tagged '", tag,
            "' already: across processes a snapshot is never replaced (it could not be replaced "
            "on every process at once); delete it first"));
      }
      auto [mine, answers] = RunEverywhere(request, authorization);
      absl::Status failed = FirstFailure(mine, answers);
      v1::SnapshotManifest manifest;
      if (failed.ok()) {
        manifest.set_head(head);
        manifest.set_tag(tag);
        manifest.set_processes(size());
        v1::SnapshotInfo info = mine->snapshot();
        uint64_t bytes = 0;
        for (int p = 0; p < size(); ++p) {
          const v1::ControlResponse& part = p == 0 ? *mine : *answers[p];
          *manifest.add_parts() = part.part();
          bytes += part.snapshot().bytes();
        }
        info.set_bytes(bytes);
        info.set_unix_time(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
        *manifest.mutable_info() = info;
        failed = snapshots_->WriteManifest(manifest);
      }
      if (!failed.ok()) {
        // No manifest: the snapshot does not exist. The parts written go where they can (a part
        // left on a process that cannot be reached is never listed, and a later take of the tag
        // writes over it).
        v1::ControlRequest abandon =
            SnapshotRequest(v1::SnapshotControl::SNAPSHOT_ABANDON, head, tag);
        abandon.set_sequence(++sequence_);
        abandon.set_origin(rank());
        RunEverywhere(abandon, authorization);
        return absl::Status(failed.code() == absl::StatusCode::kDeadlineExceeded
                                ? absl::StatusCode::kUnavailable
                                : failed.code(),
                            absl::StrCat("snapshot '", tag, "' of head '", head,
                                         "' not taken: ", failed.message()));
      }
      *response.mutable_snapshot() = manifest.info();
      return response;
    }
    case v1::SnapshotControl::SNAPSHOT_RESTORE: {
      LOSSHEAD_ASSIGN_OR_RETURN(*op.mutable_manifest(), snapshots_->ReadManifest(head, tag));
      auto [mine, answers] = RunEverywhere(request, authorization);
      // Every process agreed before anything changed: a refusal is every process's, with its code.
      LOSSHEAD_RETURN_IF_ERROR(FirstFailure(mine, answers));
      if (sets_ != nullptr) {
        // The restored state becomes what a restart comes back to, as on one process: a set.
        v1::ControlRequest set;
        set.set_sequence(++sequence_);
        set.set_origin(rank());
        set.mutable_checkpoint()->set_head(head);
        absl::StatusOr<v1::ControlResponse> kept = LeadCheckpoint(std::move(set), authorization);
        if (!kept.ok()) {
          return absl::Status(
              kept.status().code(),
              absl::StrCat("head '", head, "' was restored to snapshot '", tag,
                           "' on every process, but the checkpoint set that keeps it across a "
                           "restart was not taken: ",
                           kept.status().message()));
        }
      }
      return std::move(*mine);
    }
    case v1::SnapshotControl::SNAPSHOT_DELETE: {
      LOSSHEAD_ASSIGN_OR_RETURN(*op.mutable_manifest(), snapshots_->ReadManifest(head, tag));
      auto [mine, answers] = RunEverywhere(request, authorization);
      LOSSHEAD_RETURN_IF_ERROR(FirstFailure(mine, answers));
      return response;
    }
    default:
      return absl::InvalidArgumentError("a snapshot request without an action");
  }
}

absl::StatusOr<v1::ControlResponse> GroupControl::RunSnapshot(const v1::ControlRequest& request) {
  if (snapshots_ == nullptr) return NoCheckpoints();
  const v1::SnapshotControl& op = request.snapshot();
  v1::ControlResponse response;
  response.set_sequence(request.sequence());
  switch (op.action()) {
    case v1::SnapshotControl::SNAPSHOT_TAKE: {
      LOSSHEAD_ASSIGN_OR_RETURN(auto written, snapshots_->WritePart(op.head(), op.tag()));
      *response.mutable_part() = std::move(written.first);
      *response.mutable_snapshot() = std::move(written.second);
      return response;
    }
    case v1::SnapshotControl::SNAPSHOT_ABANDON:
      LOSSHEAD_RETURN_IF_ERROR(snapshots_->RemovePart(op.head(), op.tag()));
      return response;
    case v1::SnapshotControl::SNAPSHOT_RESTORE: {
      // What each process can tell alone (its part there, whole, the manifest's, its rows), agreed
      // before any process builds anything: a head sharded across processes is built by every
      // process together.
      absl::StatusOr<HeadCheckpointData> data = snapshots_->ReadPart(op.manifest());
      LOSSHEAD_RETURN_IF_ERROR(Agree("the checks of a snapshot's restore", data.status()));
      // Then the build (memory may fit one process and not another): the head is swapped in only
      // where every process built its own, agreed in the registry's commit, before any swap.
      bool met = false;
      absl::StatusOr<std::shared_ptr<Head>> restored = ctx_->registry->Restore(*data, [&] {
        met = true;
        return Agree("the restore of a snapshot", absl::OkStatus());
      });
      if (!met) {
        // This process could not build its head: the others wait for it in the commit's exchange.
        LOSSHEAD_RETURN_IF_ERROR(Agree("the restore of a snapshot", restored.status()));
      }
      if (!restored.ok()) return restored.status();
      ctx_->metrics->Heads(ctx_->registry->size());
      *response.mutable_head() = (*restored)->Info();
      return response;
    }
    case v1::SnapshotControl::SNAPSHOT_DELETE: {
      LOSSHEAD_RETURN_IF_ERROR(Agree("the checks of a snapshot's deletion",
                                     snapshots_->CheckPartPresent(op.manifest())));
      // The manifest first: from then on the snapshot is not listed, whatever part goes next.
      const absl::Status unlisted =
          leader() ? snapshots_->RemoveManifest(op.head(), op.tag()) : absl::OkStatus();
      LOSSHEAD_RETURN_IF_ERROR(Agree("the removal of a snapshot's manifest", unlisted));
      LOSSHEAD_RETURN_IF_ERROR(snapshots_->RemovePart(op.head(), op.tag()));
      return response;
    }
    default:
      return absl::InvalidArgumentError("a snapshot request without an action this process runs");
  }
}

}  // namespace losshead::server
