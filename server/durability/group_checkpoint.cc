#include "server/durability/group_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/posix_file.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "server/durability/checkpoint.h"

namespace losshead::server {
namespace {

namespace fs = std::filesystem;

constexpr int kCutDigits = 20;

absl::Status WriteSmallFile(const std::string& path, const std::string& data) {
  const absl::string_view pieces[] = {data};
  return WriteFileAtomically(path, pieces);
}

// A set's progress kept until it completes: the clients' sequences, without tensors or results.
HeadCheckpointData ProgressOf(const HeadCheckpointData& data) {
  HeadCheckpointData slim;
  slim.spec.set_name(data.spec.name());
  for (const ClientCheckpoint& c : data.clients) {
    slim.clients.push_back(ClientCheckpoint{
        .client_id = c.client_id, .max_evicted = c.max_evicted, .max_applied = c.max_applied});
  }
  return slim;
}

}  // namespace

CheckpointSets::CheckpointSets(std::string dir, int rank, int processes, HeadRegistry* registry,
                               CheckpointObserver observer, int keep)
    : dir_(std::move(dir)),
      rank_(rank),
      processes_(processes),
      registry_(registry),
      observer_(std::move(observer)),
      keep_(std::max(1, keep)) {}

std::string CheckpointSets::SetDir(uint64_t cut) const {
  return absl::StrFormat("%s/sets/%0*d", dir_, kCutDigits, cut);
}

absl::StatusOr<std::map<uint64_t, bool>> CheckpointSets::ListLocked() {
  const std::string sets = absl::StrCat(dir_, "/sets");
  std::error_code ec;
  fs::create_directories(sets, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create checkpoint directory ", sets, ": ", ec.message()));
  }
  std::map<uint64_t, bool> found;
  for (fs::directory_iterator it(sets, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    uint64_t cut = 0;
    if (name.size() != kCutDigits || !absl::SimpleAtoi(name, &cut) || cut == 0) continue;
    const char* marker = rank_ == 0 ? kManifestFile : kCommittedFile;
    found[cut] = fs::exists(it->path() / marker);
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list checkpoint directory ", sets, ": ", ec.message()));
  }
  return found;
}

absl::StatusOr<uint64_t> CheckpointSets::NewestComplete() {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_ASSIGN_OR_RETURN(const auto sets, ListLocked());
  uint64_t newest = 0;
  for (const auto& [cut, complete] : sets) {
    if (complete) newest = cut;
  }
  return newest;
}

absl::StatusOr<v1::CheckpointManifest> CheckpointSets::ReadManifest(uint64_t cut) {
  const std::string path = absl::StrCat(SetDir(cut), "/", kManifestFile);
  LOSSHEAD_ASSIGN_OR_RETURN(const std::string bytes,
                            ReadFileToString(path, "checkpoint set manifest"));
  v1::CheckpointManifest manifest;
  if (!manifest.ParseFromString(bytes) || manifest.cut() != cut) {
    return absl::DataLossError(absl::StrCat(path, ": not the manifest of set ", cut));
  }
  return manifest;
}

absl::Status CheckpointSets::CheckPart(const v1::CheckpointManifest& manifest) {
  const std::string dir = SetDir(manifest.cut());
  if (manifest.processes() != processes_) {
    return absl::DataLossError(absl::StrCat("the manifest of set ", manifest.cut(), " is of ",
                                            manifest.processes(), " processes, the group has ",
                                            processes_));
  }
  const v1::CheckpointPart* part = nullptr;
  for (const v1::CheckpointPart& p : manifest.parts()) {
    if (p.rank() == rank_) part = &p;
  }
  if (part == nullptr) {
    return absl::DataLossError(
        absl::StrCat("the manifest of set ", manifest.cut(), " lists no part of process ", rank_));
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("process ", rank_, " holds no part of set ",
                                            manifest.cut(), ": ", dir, " is missing"));
  }
  std::set<std::string> listed;
  for (const v1::CheckpointPartFile& file : part->files()) {
    listed.insert(file.name());
    const std::string path = absl::StrCat(dir, "/", file.name());
    absl::StatusOr<CheckpointDigest> digest = ReadCheckpointDigest(path);
    if (absl::IsNotFound(digest.status())) {
      return absl::NotFoundError(
          absl::StrCat("process ", rank_, "'s part of set ", manifest.cut(), " lacks ", path));
    }
    if (!digest.ok()) return digest.status();
    if (digest->bytes != file.bytes() || digest->checksum != file.digest()) {
      return absl::DataLossError(absl::StrCat(
          path, " is not the file the manifest of set ", manifest.cut(), " lists (", digest->bytes,
          " bytes, digest ", absl::Hex(digest->checksum), "; listed: ", file.bytes(),
          " bytes, digest ", absl::Hex(file.digest()), ")"));
    }
  }
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() > std::strlen(kCheckpointSuffix) &&
        name.substr(name.size() - std::strlen(kCheckpointSuffix)) == kCheckpointSuffix &&
        !listed.contains(name)) {
      return absl::DataLossError(
          absl::StrCat(dir, "/", name, " is not in the manifest of set ", manifest.cut()));
    }
  }
  if (ec)
    return absl::FailedPreconditionError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status CheckpointSets::CheckRows(const v1::CheckpointManifest& manifest) {
  for (const v1::CheckpointPart& p : manifest.parts()) {
    if (p.rank() != rank_) continue;
    for (const v1::CheckpointPartFile& file : p.files()) {
      const std::string path = absl::StrCat(SetDir(manifest.cut()), "/", file.name());
      LOSSHEAD_ASSIGN_OR_RETURN(const HeadCheckpointData meta, ReadCheckpointMeta(path));
      if (!meta.rows.has_value()) continue;
      LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<kernels::Backend*> devices,
                                registry_->Place(meta.spec.placement(), /*at_most=*/true));
      if (absl::Status s = CheckPartRows(*meta.rows, meta.spec, processes_, rank_,
                                         static_cast<int>(devices.size()));
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointSets::Restore(uint64_t cut) {
  absl::MutexLock lock(&mu_);
  Checkpointer reader(SetDir(cut), registry_, observer_);
  return reader.RestoreAll();
}

absl::Status CheckpointSets::Settle(uint64_t cut) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_ASSIGN_OR_RETURN(const auto sets, ListLocked());
  for (const auto& [c, complete] : sets) {
    if (c <= cut) continue;
    std::error_code ec;
    fs::remove_all(SetDir(c), ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot remove ", SetDir(c), " (newer than set ", cut, "): ", ec.message()));
    }
  }
  if (auto it = sets.find(cut); cut != 0 && rank_ != 0 && it != sets.end() && !it->second) {
    LOSSHEAD_RETURN_IF_ERROR(
        WriteSmallFile(absl::StrCat(SetDir(cut), "/", kCommittedFile), absl::StrCat(cut, "\n")));
  }
  return PruneLocked();
}

absl::StatusOr<std::pair<v1::CheckpointPart, v1::CheckpointResponse>> CheckpointSets::WritePart(
    uint64_t cut) {
  absl::MutexLock lock(&mu_);
  const std::string dir = SetDir(cut);
  std::error_code ec;
  fs::remove_all(dir, ec);  // a part of a set that never completed, under the same number
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  LOSSHEAD_RETURN_IF_ERROR(SyncDirectory(absl::StrCat(dir_, "/sets")));
  v1::CheckpointPart part;
  part.set_rank(rank_);
  v1::CheckpointResponse response;
  std::vector<std::pair<std::shared_ptr<Head>, HeadCheckpointData>> progress;
  for (const std::shared_ptr<Head>& head : registry_->List()) {
    const absl::Time start = absl::Now();
    auto failed = [&](const absl::Status& error) {
      if (observer_) {
        observer_({.kind = CheckpointEvent::Kind::kFailed,
                   .head = head->name(),
                   .duration = absl::Now() - start,
                   .error = error});
      }
      return error;
    };
    // A head sharded across processes: this process's rows (its part of the head).
    absl::StatusOr<HeadCheckpointData> data = head->SnapshotPart();
    if (!data.ok()) return failed(data.status());
    const std::string name = absl::StrCat(head->name(), kCheckpointSuffix);
    const std::string path = absl::StrCat(dir, "/", name);
    absl::StatusOr<uint64_t> written = WriteCheckpointFile(path, *data);
    if (!written.ok()) return failed(written.status());
    absl::StatusOr<CheckpointDigest> digest = ReadCheckpointDigest(path);
    if (!digest.ok()) return failed(digest.status());
    v1::CheckpointPartFile* file = part.add_files();
    file->set_name(name);
    file->set_bytes(digest->bytes);
    file->set_digest(digest->checksum);
    if (observer_) {
      observer_({.kind = CheckpointEvent::Kind::kWritten,
                 .head = head->name(),
                 .bytes = *written,
                 .duration = absl::Now() - start,
                 .persisted_at = absl::Now()});
    }
    v1::HeadCheckpoint* info = response.add_heads();
    info->set_head(head->name());
    info->set_weights_version(data->weights_version);
    info->set_microbatches_since_pull(data->microbatches_since_pull);
    info->set_bytes(*written);
    info->set_write_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    for (const ClientCheckpoint& c : data->clients) {
      v1::ClientProgress* p = info->add_clients();
      p->set_client_id(c.client_id);
      if (c.max_applied.has_value()) {
        p->set_acknowledged_sequence(*c.max_applied);
        p->set_persisted_sequence(*c.max_applied);
      }
    }
    progress.emplace_back(head, ProgressOf(*data));
  }
  pending_[cut] = std::move(progress);
  return std::make_pair(std::move(part), std::move(response));
}

absl::Status CheckpointSets::WriteManifest(const v1::CheckpointManifest& manifest) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(WriteSmallFile(absl::StrCat(SetDir(manifest.cut()), "/", kManifestFile),
                                          manifest.SerializeAsString()));
  return CompleteLocked(manifest.cut());
}

absl::Status CheckpointSets::Commit(uint64_t cut) {
  absl::MutexLock lock(&mu_);
  std::error_code ec;
  if (!fs::is_directory(SetDir(cut), ec)) {
    return absl::NotFoundError(
        absl::StrCat("set ", cut, " is complete but this process holds no part of it"));
  }
  LOSSHEAD_RETURN_IF_ERROR(
      WriteSmallFile(absl::StrCat(SetDir(cut), "/", kCommittedFile), absl::StrCat(cut, "\n")));
  return CompleteLocked(cut);
}

void CheckpointSets::Abandon(uint64_t cut) {
  absl::MutexLock lock(&mu_);
  pending_.erase(cut);
}

absl::Status CheckpointSets::CompleteLocked(uint64_t cut) {
  auto it = pending_.find(cut);
  if (it != pending_.end()) {
    for (const auto& [head, data] : it->second) head->MarkPersisted(data);
  }
  // Older parts never completed (their sets failed): what they covered is in this one.
  pending_.erase(pending_.begin(), pending_.upper_bound(cut));
  return PruneLocked();
}

absl::Status CheckpointSets::PruneLocked() {
  LOSSHEAD_ASSIGN_OR_RETURN(const auto sets, ListLocked());
  std::vector<uint64_t> complete;
  for (const auto& [cut, done] : sets) {
    if (done) complete.push_back(cut);
  }
  if (complete.empty()) return absl::OkStatus();
  std::sort(complete.rbegin(), complete.rend());
  const uint64_t oldest_kept = complete[std::min<size_t>(complete.size(), keep_) - 1];
  for (const auto& [cut, done] : sets) {
    if (cut >= oldest_kept) break;
    std::error_code ec;
    fs::remove_all(SetDir(cut), ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot remove old checkpoint set ", SetDir(cut), ": ", ec.message()));
    }
  }
  return absl::OkStatus();
}

namespace {

uint64_t U64At(const std::vector<std::byte>& bytes, size_t offset) {
  uint64_t v = 0;
  std::memcpy(&v, bytes.data() + offset, sizeof(v));
  return v;
}

}  // namespace

absl::Status AgreeOnCheckpoints(kernels::ProcessGroup& group, bool enabled) {
  const std::vector<std::byte> mine = {enabled ? std::byte{1} : std::byte{0}};
  LOSSHEAD_ASSIGN_OR_RETURN(const auto all,
                            group.AllGather("whether the processes keep checkpoints", mine));
  for (int p = 0; p < group.size(); ++p) {
    if ((all[p][0] == std::byte{1}) != enabled) {
      const int with = enabled ? group.rank() : p;
      const int without = enabled ? p : group.rank();
      return absl::FailedPreconditionError(
          absl::StrCat("process ", with, " has a --checkpoint_dir and process ", without,
                       " has none: every process of a group keeps checkpoints, or none does"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RestoreAgreedSet(kernels::ProcessGroup& group, CheckpointSets& sets) {
  // Round 1: every process's newest complete set; the leader's also says how long its manifest is
  // and whether it could read it.
  absl::Status mine = absl::OkStatus();
  absl::StatusOr<uint64_t> newest = sets.NewestComplete();
  if (!newest.ok()) mine = newest.status();
  std::string manifest_bytes;
  if (mine.ok() && group.rank() == 0 && *newest != 0) {
    absl::StatusOr<v1::CheckpointManifest> manifest = sets.ReadManifest(*newest);
    if (manifest.ok()) {
      manifest_bytes = manifest->SerializeAsString();
    } else {
      mine = manifest.status();
    }
  }
  std::vector<std::byte> first(3 * sizeof(uint64_t), std::byte{0});
  const uint64_t head[3] = {newest.value_or(0), manifest_bytes.size(), mine.ok() ? 1u : 0u};
  std::memcpy(first.data(), head, sizeof(head));
  LOSSHEAD_ASSIGN_OR_RETURN(const auto firsts,
                            group.AllGather("the newest checkpoint sets", first));
  const uint64_t cut = U64At(firsts[0], 0);
  const uint64_t length = U64At(firsts[0], sizeof(uint64_t));
  const bool leader_ok = U64At(firsts[0], 2 * sizeof(uint64_t)) == 1;
  // Round 2: the leader's manifest to every process.
  v1::CheckpointManifest manifest;
  if (leader_ok && cut != 0) {
    std::vector<std::byte> padded(length, std::byte{0});
    if (group.rank() == 0) std::memcpy(padded.data(), manifest_bytes.data(), length);
    LOSSHEAD_ASSIGN_OR_RETURN(const auto manifests,
                              group.AllGather("the checkpoint set's manifest", padded));
    if (!manifest.ParseFromArray(manifests[0].data(), static_cast<int>(length)) && mine.ok()) {
      mine = absl::DataLossError("the leader's manifest did not parse here");
    }
  }
  if (mine.ok() && leader_ok && *newest > cut) {
    mine = absl::FailedPreconditionError(absl::StrCat(
        "process ", group.rank(), " holds set ", *newest,
        ", complete, newer than the newest set the leader has a manifest for (",
        cut == 0 ? std::string("none") : absl::StrCat(cut),
        "): the leader's --checkpoint_dir is not the one it wrote; not restoring an older state"));
  }
  if (leader_ok && cut != 0) {
    // The same on every process (the leader's cut and state): every process takes part in the
    // exchange below, a process that failed already included, or the others would wait for it.
    if (mine.ok()) mine = sets.CheckPart(manifest);
    if (mine.ok()) mine = sets.CheckRows(manifest);
    // Every part checked everywhere before any is restored: a head sharded across processes is
    // restored by every process together (its collective is created by all of them), so no
    // process may start while another will not follow.
    LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<absl::Status> checks,
                              GatherStatuses(group, "the checkpoint parts' checks", mine));
    bool all_checked = true;
    for (const absl::Status& check : checks) all_checked = all_checked && check.ok();
    if (mine.ok() && all_checked) mine = sets.Restore(cut);
  }
  // Round 3: every verdict to every process, so that all fail alike, with the same reason.
  LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<absl::Status> verdicts,
                            GatherStatuses(group, "the checkpoint restore's verdicts", mine));
  for (int p = 0; p < group.size(); ++p) {
    const absl::Status& verdict = verdicts[p];
    if (!verdict.ok()) {
      return absl::Status(verdict.code(),
                          absl::StrCat("checkpoint set ", cut, " cannot be restored: process ", p,
                                       ": ", verdict.message()));
    }
  }
  LOSSHEAD_RETURN_IF_ERROR(sets.Settle(cut));
  return cut;
}

}  // namespace losshead::server
