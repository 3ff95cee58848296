#include "server/durability/group_snapshots.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/posix_file.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "server/durability/checkpoint.h"

namespace losshead::server {
namespace {

namespace fs = std::filesystem;

absl::Status NoSnapshot(const std::string& head, const std::string& tag) {
  return absl::NotFoundError(
      absl::StrCat("head '", head, "' has no snapshot tagged '", tag, "' in the process group"));
}

}  // namespace

GroupSnapshots::GroupSnapshots(std::string dir, int rank, int processes, HeadRegistry* registry,
                               CheckpointObserver observer)
    : dir_(absl::StrCat(dir, "/", kGroupSnapshotsDir)),
      rank_(rank),
      processes_(processes),
      registry_(registry),
      observer_(std::move(observer)) {}

std::string GroupSnapshots::PartPath(const std::string& head, const std::string& tag) const {
  return absl::StrCat(dir_, "/", tag, "/", head, kCheckpointSuffix);
}

std::string GroupSnapshots::ManifestPath(const std::string& head, const std::string& tag) const {
  return absl::StrCat(dir_, "/", tag, "/", head, kSnapshotManifestSuffix);
}

absl::StatusOr<v1::SnapshotManifest> GroupSnapshots::ReadManifest(const std::string& head,
                                                                  const std::string& tag) const {
  const std::string path = ManifestPath(head, tag);
  absl::StatusOr<std::string> bytes = ReadFileToString(path, "snapshot manifest");
  if (absl::IsNotFound(bytes.status())) return NoSnapshot(head, tag);
  if (!bytes.ok()) return bytes.status();
  v1::SnapshotManifest manifest;
  if (!manifest.ParseFromString(*bytes) || manifest.head() != head || manifest.tag() != tag) {
    return absl::DataLossError(
        absl::StrCat(path, ": not the manifest of head '", head, "''s snapshot '", tag, "'"));
  }
  return manifest;
}

absl::StatusOr<std::vector<v1::SnapshotInfo>> GroupSnapshots::List(const std::string& head) const {
  std::vector<v1::SnapshotInfo> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string tag = it->path().filename().string();
    if (!Checkpointer::ValidateTag(tag).ok()) continue;
    absl::StatusOr<v1::SnapshotManifest> manifest = ReadManifest(head, tag);
    if (manifest.ok()) out.push_back(manifest->info());
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return absl::InternalError(absl::StrCat("cannot list ", dir_, ": ", ec.message()));
  }
  std::sort(out.begin(), out.end(),
            [](const v1::SnapshotInfo& a, const v1::SnapshotInfo& b) { return a.tag() < b.tag(); });
  return out;
}

absl::StatusOr<std::pair<v1::CheckpointPart, v1::SnapshotInfo>> GroupSnapshots::WritePart(
    const std::string& head, const std::string& tag) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> h, registry_->Get(head));
  const absl::Time start = absl::Now();
  auto failed = [&](const absl::Status& error) {
    if (observer_) {
      observer_({.kind = CheckpointEvent::Kind::kFailed,
                 .head = head,
                 .duration = absl::Now() - start,
                 .error = error});
    }
    return error;
  };
  // This process's part: a head sharded across processes gives its rows only.
  absl::StatusOr<HeadCheckpointData> data = h->SnapshotPart();
  if (!data.ok()) return failed(data.status());
  const std::string tag_dir = absl::StrCat(dir_, "/", tag);
  std::error_code ec;
  if (fs::create_directories(tag_dir, ec)) {
    // New directories: their entries must be durable before the file in them is.
    if (absl::Status s = SyncDirectory(dir_); !s.ok()) return failed(s);
    if (absl::Status s = SyncDirectory(fs::path(dir_).parent_path().string()); !s.ok()) {
      return failed(s);
    }
  } else if (ec) {
    return failed(absl::InternalError(absl::StrCat("cannot create ", tag_dir, ": ", ec.message())));
  }
  const std::string path = PartPath(head, tag);
  absl::StatusOr<uint64_t> written = WriteCheckpointFile(path, *data);
  if (!written.ok()) return failed(written.status());
  absl::StatusOr<CheckpointDigest> digest = ReadCheckpointDigest(path);
  if (!digest.ok()) return failed(digest.status());
  v1::CheckpointPart part;
  part.set_rank(rank_);
  v1::CheckpointPartFile* file = part.add_files();
  file->set_name(fs::path(path).filename().string());
  file->set_bytes(digest->bytes);
  file->set_digest(digest->checksum);
  v1::SnapshotInfo info;
  info.set_tag(tag);
  info.set_head(head);
  info.set_weights_version(data->weights_version);
  info.set_optimizer_step(data->optimizer_step);
  info.set_bytes(*written);
  info.set_unix_time(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  return std::make_pair(std::move(part), std::move(info));
}

absl::Status GroupSnapshots::WriteManifest(const v1::SnapshotManifest& manifest) {
  absl::MutexLock lock(&mu_);
  const std::string bytes = manifest.SerializeAsString();
  const absl::string_view pieces[] = {bytes};
  return WriteFileAtomically(ManifestPath(manifest.head(), manifest.tag()), pieces);
}

const v1::CheckpointPart* GroupSnapshots::PartOf(const v1::SnapshotManifest& manifest) const {
  for (const v1::CheckpointPart& p : manifest.parts()) {
    if (p.rank() == rank_ && p.files_size() == 1) return &p;
  }
  return nullptr;
}

absl::Status GroupSnapshots::CheckPartPresent(const v1::SnapshotManifest& manifest) const {
  const std::string path = PartPath(manifest.head(), manifest.tag());
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("process ", rank_, " holds no part of head '",
                                              manifest.head(), "''s snapshot '", manifest.tag(),
                                              "': ", path, " is missing"));
    }
    return PosixError("cannot stat", path);
  }
  return absl::OkStatus();
}

absl::StatusOr<HeadCheckpointData> GroupSnapshots::ReadPart(
    const v1::SnapshotManifest& manifest) const {
  const std::string path = PartPath(manifest.head(), manifest.tag());
  if (manifest.processes() != processes_) {
    return absl::DataLossError(absl::StrCat("the manifest of snapshot '", manifest.tag(),
                                            "' is of ", manifest.processes(),
                                            " processes, the group has ", processes_));
  }
  const v1::CheckpointPart* part = PartOf(manifest);
  if (part == nullptr) {
    return absl::DataLossError(absl::StrCat("the manifest of snapshot '", manifest.tag(),
                                            "' lists no part of process ", rank_));
  }
  LOSSHEAD_RETURN_IF_ERROR(CheckPartPresent(manifest));
  LOSSHEAD_ASSIGN_OR_RETURN(const CheckpointDigest digest, ReadCheckpointDigest(path));
  const v1::CheckpointPartFile& listed = part->files(0);
  if (digest.bytes != listed.bytes() || digest.checksum != listed.digest()) {
    return absl::DataLossError(absl::StrCat(
        path, " (process ", rank_, ") is not the file the manifest of snapshot '", manifest.tag(),
        "' lists (", digest.bytes, " bytes, digest ", absl::Hex(digest.checksum),
        "; listed: ", listed.bytes(), " bytes, digest ", absl::Hex(listed.digest()), ")"));
  }
  // The whole file, its checksum verified.
  LOSSHEAD_ASSIGN_OR_RETURN(HeadCheckpointData data, ReadCheckpointFile(path));
  if (data.spec.name() != manifest.head()) {
    return absl::DataLossError(
        absl::StrCat(path, ": holds head '", data.spec.name(), "', not '", manifest.head(), "'"));
  }
  if (data.rows.has_value()) {
    LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<kernels::Backend*> devices,
                              registry_->Place(data.spec.placement(), /*at_most=*/true));
    if (absl::Status s = CheckPartRows(*data.rows, data.spec, processes_, rank_,
                                       static_cast<int>(devices.size()));
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
    }
  }
  return data;
}

absl::Status GroupSnapshots::RemoveManifest(const std::string& head, const std::string& tag) {
  absl::MutexLock lock(&mu_);
  const std::string path = ManifestPath(head, tag);
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return NoSnapshot(head, tag);
    return PosixError("cannot delete", path);
  }
  return SyncDirectory(absl::StrCat(dir_, "/", tag));
}

absl::Status GroupSnapshots::RemovePart(const std::string& head, const std::string& tag) {
  absl::MutexLock lock(&mu_);
  const std::string path = PartPath(head, tag);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return PosixError("cannot delete", path);
  // The tag's directory goes with its last file (it keeps other heads' of the same tag).
  ::rmdir(absl::StrCat(dir_, "/", tag).c_str());
  return absl::OkStatus();
}

}  // namespace losshead::server
