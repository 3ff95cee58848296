// The checkpointer's named snapshots: snapshots/<tag>/<head>.lhck beside the heads' checkpoints
// (see checkpointer.h). A trainer's checkpoint names one; restoring it puts the head back to that
// step, optimizer state included.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/posix_file.h"
#include "server/durability/checkpoint.h"
#include "server/durability/checkpointer.h"
#include "common/status_macros.h"

namespace losshead::server {
namespace {

constexpr char kSnapshotsDir[] = "snapshots";

absl::Status NoSnapshot(const std::string& head, const std::string& tag, const std::string& path) {
  return absl::NotFoundError(
      absl::StrCat("head '", head, "' has no snapshot tagged '", tag, "' (", path, ")"));
}

double UnixSeconds(const struct stat& st) {
  return static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
}

}  // namespace

absl::Status Checkpointer::ValidateTag(const std::string& tag) {
  bool ok = !tag.empty() && tag.size() <= 128 && tag[0] != '.';
  for (char c : tag) {
    ok = ok && ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '.' || c == '-');
  }
  if (!ok) {
    // Not starting with '.': no tag names "." or "..", or hides its directory.
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot tag must match [A-Za-z0-9._-]{1,128} and not start with '.', got '",
                     tag.substr(0, 160), "'"));
  }
  return absl::OkStatus();
}

std::string Checkpointer::SnapshotPath(const std::string& head, const std::string& tag) const {
  return absl::StrCat(dir_, "/", kSnapshotsDir, "/", tag, "/", head, kCheckpointSuffix);
}

absl::StatusOr<v1::SnapshotInfo> Checkpointer::WriteSnapshot(const std::string& head,
                                                             const std::string& tag) {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateName(head));
  LOSSHEAD_RETURN_IF_ERROR(ValidateTag(tag));
  absl::MutexLock lock(&mu_);
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> h, registry_->Get(head));
  LOSSHEAD_ASSIGN_OR_RETURN(HeadCheckpointData data, h->Snapshot());
  const std::string snapshots = absl::StrCat(dir_, "/", kSnapshotsDir);
  const std::string tag_dir = absl::StrCat(snapshots, "/", tag);
  std::error_code ec;
  if (std::filesystem::create_directories(tag_dir, ec)) {
    // New directories: their entries must be durable before the file in them is.
    LOSSHEAD_RETURN_IF_ERROR(SyncDirectory(snapshots));
    LOSSHEAD_RETURN_IF_ERROR(SyncDirectory(dir_));
  } else if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", tag_dir, ": ", ec.message()));
  }
  const std::string path = SnapshotPath(head, tag);
  LOSSHEAD_ASSIGN_OR_RETURN(const uint64_t bytes, WriteCheckpointFile(path, data));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return PosixError("cannot stat", path);
  v1::SnapshotInfo info;
  info.set_tag(tag);
  info.set_head(head);
  info.set_weights_version(data.weights_version);
  info.set_optimizer_step(data.optimizer_step);
  info.set_bytes(bytes);
  info.set_unix_time(UnixSeconds(st));
  return info;
}

absl::Status Checkpointer::AdoptSnapshot(const std::string& snapshot,
                                         const HeadCheckpointData& data) {
  const std::string target = PathOf(data.spec.name());
  const std::string tmp = absl::StrCat(target, ".tmp");
  ::unlink(tmp.c_str());  // left by an interrupted write: link() would not replace it
  // A second name for the snapshot's file costs nothing, and it stays the snapshot's: every later
  // write of the checkpoint writes a new file and renames it over this name.
  if (::link(snapshot.c_str(), tmp.c_str()) != 0) {
    // No hard links on this file system (or not permitted): the same bytes, written.
    return WriteCheckpointFile(target, data).status();
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    absl::Status s = PosixError("cannot rename onto", target);
    ::unlink(tmp.c_str());
    return s;
  }
  return SyncDirectory(dir_);
}

absl::StatusOr<std::shared_ptr<Head>> Checkpointer::RestoreSnapshot(const std::string& head,
                                                                    const std::string& tag) {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateName(head));
  LOSSHEAD_RETURN_IF_ERROR(ValidateTag(tag));
  absl::MutexLock lock(&mu_);
  const std::string path = SnapshotPath(head, tag);
  absl::StatusOr<HeadCheckpointData> data = ReadCheckpointFile(path);
  if (absl::IsNotFound(data.status())) return NoSnapshot(head, tag, path);
  if (!data.ok()) return data.status();  // names the file
  if (data->spec.name() != head) {
    return absl::DataLossError(
        absl::StrCat(path, ": holds head '", data->spec.name(), "', not '", head, "'"));
  }
  absl::StatusOr<std::shared_ptr<Head>> restored =
      registry_->Restore(*data, [&] { return AdoptSnapshot(path, *data); });
  if (absl::IsDataLoss(restored.status())) {
    return absl::DataLossError(
        absl::StrCat(path, ": cannot restore: ", restored.status().message()));
  }
  if (restored.ok()) {
    // The head's checkpoint now holds exactly its state: as fresh as a write (none counted).
    struct stat st;
    const bool sized = ::stat(PathOf(head).c_str(), &st) == 0;
    Report({.kind = CheckpointEvent::Kind::kRestored,
            .head = head,
            .bytes = sized ? static_cast<uint64_t>(st.st_size) : 0,
            .persisted_at = absl::Now()});
  }
  return restored;
}

absl::Status Checkpointer::DeleteSnapshot(const std::string& head, const std::string& tag) {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateName(head));
  LOSSHEAD_RETURN_IF_ERROR(ValidateTag(tag));
  absl::MutexLock lock(&mu_);
  const std::string path = SnapshotPath(head, tag);
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return NoSnapshot(head, tag, path);
    return PosixError("cannot delete", path);
  }
  // The tag's directory goes with its last snapshot (it keeps others' of the same tag).
  ::rmdir(absl::StrCat(dir_, "/", kSnapshotsDir, "/", tag).c_str());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::SnapshotInfo>> Checkpointer::ListSnapshots(const std::string& head) {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateName(head));
  namespace fs = std::filesystem;
  // No lock: a listing must not wait behind a long write, and a file renamed or deleted while it
  // runs is either listed whole or left out.
  std::vector<v1::SnapshotInfo> out;
  std::error_code ec;
  const std::string snapshots = absl::StrCat(dir_, "/", kSnapshotsDir);
  for (fs::directory_iterator it(snapshots, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string tag = it->path().filename().string();
    if (!ValidateTag(tag).ok()) continue;
    const std::string path = SnapshotPath(head, tag);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    v1::SnapshotInfo info;
    info.set_tag(tag);
    info.set_head(head);
    info.set_bytes(static_cast<uint64_t>(st.st_size));
    info.set_unix_time(UnixSeconds(st));
    absl::StatusOr<HeadCheckpointData> meta = ReadCheckpointMeta(path);
    if (meta.ok() && meta->spec.name() == head) {
      info.set_weights_version(meta->weights_version);
      info.set_optimizer_step(meta->optimizer_step);
    }
    out.push_back(std::move(info));
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return absl::InternalError(absl::StrCat("cannot list ", snapshots, ": ", ec.message()));
  }
  std::sort(out.begin(), out.end(),
            [](const v1::SnapshotInfo& a, const v1::SnapshotInfo& b) { return a.tag() < b.tag(); });
  return out;
}

absl::Status Checkpointer::RemoveSnapshotTemporaries() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string snapshots = absl::StrCat(dir_, "/", kSnapshotsDir);
  for (fs::directory_iterator tags(snapshots, ec), end; !ec && tags != end; tags.increment(ec)) {
    if (!tags->is_directory(ec)) continue;
    for (fs::directory_iterator it(tags->path(), ec); !ec && it != end; it.increment(ec)) {
      if (absl::EndsWith(it->path().filename().string(), absl::StrCat(kCheckpointSuffix, ".tmp"))) {
        fs::remove(it->path(), ec);
      }
    }
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot clean snapshot directory ", snapshots, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
