#include "server/durability/checkpointer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/durability/checkpoint.h"
#include "common/status_macros.h"

namespace losshead::server {

Checkpointer::~Checkpointer() { StopPeriodic(); }

std::string Checkpointer::PathOf(const std::string& head) const {
  return absl::StrCat(dir_, "/", head, kCheckpointSuffix);
}

absl::Status Checkpointer::RestoreAll() {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create checkpoint directory ", dir_, ": ", ec.message()));
  }
  std::vector<std::string> files;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (absl::EndsWith(name, absl::StrCat(kCheckpointSuffix, ".tmp"))) {
      // A write that a crash interrupted: the previous checkpoint (if any) is still in place.
      fs::remove(it->path(), ec);
      if (ec) break;
    } else if (absl::EndsWith(name, kCheckpointSuffix)) {
      files.push_back(it->path().string());
    }
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list checkpoint directory ", dir_, ": ", ec.message()));
  }
  LOSSHEAD_RETURN_IF_ERROR(RemoveSnapshotTemporaries());
  std::sort(files.begin(), files.end());
  for (const std::string& path : files) {
    const absl::Time start = absl::Now();
    absl::StatusOr<HeadCheckpointData> data = ReadCheckpointFile(path);
    if (!data.ok()) return data.status();  // names the file
    const std::string expected = fs::path(path).filename().string();
    if (absl::StrCat(data->spec.name(), kCheckpointSuffix) != expected) {
      return absl::DataLossError(absl::StrCat(path, ": holds head '", data->spec.name(),
                                              "', which belongs in ", data->spec.name(),
                                              kCheckpointSuffix));
    }
    absl::StatusOr<std::vector<kernels::Backend*>> devices =
        registry_->Place(data->spec.placement(), /*at_most=*/true);
    absl::StatusOr<std::shared_ptr<Head>> head =
        devices.ok() ? Head::Restore(*devices, *data, registry_->head_options()) : devices.status();
    if (!head.ok()) {
      return absl::Status(head.status().code(),
                          absl::StrCat(path, ": cannot restore: ", head.status().message()));
    }
    LOSSHEAD_RETURN_IF_ERROR(registry_->Adopt(std::move(*head)));
    CheckpointEvent event{.kind = CheckpointEvent::Kind::kRestored,
                          .head = data->spec.name(),
                          .duration = absl::Now() - start};
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) {
      event.bytes = static_cast<uint64_t>(st.st_size);
      event.persisted_at = absl::TimeFromTimespec(st.st_mtim);
    } else {
      event.persisted_at = absl::Now();  // read a moment ago: no older than that
    }
    Report(event);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::HeadCheckpoint> Checkpointer::WriteLocked(const std::shared_ptr<Head>& head) {
  const absl::Time start = absl::Now();
  auto failed = [&](const absl::Status& error) {
    Report({.kind = CheckpointEvent::Kind::kFailed,
            .head = head->name(),
            .duration = absl::Now() - start,
            .error = error});
    return error;
  };
  absl::StatusOr<HeadCheckpointData> snapshot = head->Snapshot();
  if (!snapshot.ok()) return failed(snapshot.status());
  HeadCheckpointData& data = *snapshot;
  // A head deleted after it was listed must not come back at the next start. DeleteHead drops it
  // from the registry under mu_, so either we see it gone here or its file goes after us.
  absl::StatusOr<std::shared_ptr<Head>> current = registry_->Get(head->name());
  if (!current.ok() || *current != head) {
    return absl::NotFoundError(absl::StrCat("head '", head->name(), "' was deleted"));
  }
  absl::StatusOr<uint64_t> written = WriteCheckpointFile(PathOf(head->name()), data);
  if (!written.ok()) return failed(written.status());
  const uint64_t bytes = *written;
  head->MarkPersisted(data);
  Report({.kind = CheckpointEvent::Kind::kWritten,
          .head = head->name(),
          .bytes = bytes,
          .duration = absl::Now() - start,
          .persisted_at = absl::Now()});
  v1::HeadCheckpoint info;
  info.set_head(head->name());
  info.set_weights_version(data.weights_version);
  info.set_microbatches_since_pull(data.microbatches_since_pull);
  info.set_bytes(bytes);
  info.set_write_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  for (const ClientCheckpoint& c : data.clients) {
    v1::ClientProgress* p = info.add_clients();
    p->set_client_id(c.client_id);
    if (c.max_applied.has_value()) {
      p->set_acknowledged_sequence(*c.max_applied);
      p->set_persisted_sequence(*c.max_applied);
    }
  }
  return info;
}

absl::StatusOr<v1::CheckpointResponse> Checkpointer::Write(const std::string& head) {
  v1::CheckpointResponse response;
  absl::MutexLock lock(&mu_);
  if (!head.empty()) {
    LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> h, registry_->Get(head));
    LOSSHEAD_ASSIGN_OR_RETURN(*response.add_heads(), WriteLocked(h));
    return response;
  }
  for (const std::shared_ptr<Head>& h : registry_->List()) {
    absl::StatusOr<v1::HeadCheckpoint> info = WriteLocked(h);
    if (info.ok()) {
      *response.add_heads() = std::move(*info);
    } else if (!absl::IsNotFound(info.status())) {  // deleted meanwhile: nothing to keep
      return info.status();
    }
  }
  return response;
}

absl::Status Checkpointer::DeleteHead(const std::string& head) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(registry_->Delete(head));
  const std::string path = PathOf(head);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::InternalError(absl::StrCat("cannot delete ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void Checkpointer::StartPeriodic(absl::Duration interval) {
  if (periodic_.joinable() || interval <= absl::ZeroDuration()) return;
  stop_ = std::make_unique<absl::Notification>();
  periodic_ = std::thread([this, interval, stop = stop_.get()] {
    while (!stop->WaitForNotificationWithTimeout(interval)) {
      absl::StatusOr<v1::CheckpointResponse> written = Write("");
      if (!written.ok()) {
        std::fprintf(stderr, "losshead-server: periodic checkpoint failed: %s\n",
                     written.status().ToString().c_str());
      }
    }
  });
}

void Checkpointer::StopPeriodic() {
  if (!periodic_.joinable()) return;
  stop_->Notify();
  periodic_.join();
}

}  // namespace losshead::server
