#include "server/rpc/shared_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace losshead::server {
namespace {

// Constant time in the bytes compared, so that a key is not learnt byte by byte.
bool SameBytes(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  uint8_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ |= static_cast<uint8_t>(a[i] ^ b[i]);
  return differ == 0;
}

}  // namespace

SharedRegion::~SharedRegion() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (counters_ != nullptr) {
    counters_->regions.fetch_sub(1);
    counters_->bytes.fetch_sub(size_);
  }
}

absl::Status SharedRegion::CheckRange(absl::string_view what, uint64_t offset,
                                      uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat(what, " [", offset, ", ", offset, " + ", bytes,
                                              ") lies outside shared memory region ", id_, " of ",
                                              size_, " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedRegion>> SharedRegions::Register(int fd, uint64_t bytes,
                                                                      std::string principal) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("the descriptor sent is not a memfd (a regular file)");
  }
  if (bytes == 0 || bytes > static_cast<uint64_t>(st.st_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a region of ", bytes, " bytes in a file of ", st.st_size, " bytes"));
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        "the memfd is not sealed against shrinking (fcntl F_ADD_SEALS F_SEAL_SHRINK): the server "
        "maps only memory that cannot be truncated under it");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", bytes, " bytes: ", std::strerror(errno)));
  }
  auto region = std::unique_ptr<SharedRegion>(new SharedRegion());
  region->base_ = static_cast<uint8_t*>(base);
  region->size_ = bytes;
  region->principal_ = std::move(principal);
  return Add(std::move(region));
}

absl::StatusOr<std::shared_ptr<SharedRegion>> SharedRegions::RegisterDevice(
    absl::string_view handle, uint64_t offset, uint64_t bytes, absl::string_view pci_bus_id,
    std::string principal) {
  absl::StatusOr<std::unique_ptr<DeviceMapping>> mapping =
      DeviceMapping::Open(devices_, handle, offset, bytes, pci_bus_id);
  if (!mapping.ok()) return mapping.status();
  auto region = std::unique_ptr<SharedRegion>(new SharedRegion());
  region->device_ = *std::move(mapping);
  region->size_ = bytes;
  region->principal_ = std::move(principal);
  return Add(std::move(region));
}

absl::StatusOr<std::shared_ptr<SharedRegion>> SharedRegions::Add(
    std::unique_ptr<SharedRegion> owned) {
  std::shared_ptr<SharedRegion> region = std::move(owned);
  region->counters_ = counters_;
  counters_->regions.fetch_add(1);
  counters_->bytes.fetch_add(region->size_);
  if (::getrandom(region->key_.data(), region->key_.size(), 0) !=
      static_cast<ssize_t>(region->key_.size())) {
    return absl::InternalError("no random bytes for a region key");
  }
  absl::MutexLock lock(&mu_);
  region->id_ = next_id_++;
  regions_[region->id_] = region;
  return region;
}

void SharedRegions::Unregister(uint64_t id) {
  std::shared_ptr<SharedRegion> gone;  // unmapped outside the lock
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  gone = std::move(it->second);
  gone->registered_.store(false, std::memory_order_release);
  regions_.erase(it);
}

absl::StatusOr<std::shared_ptr<SharedRegion>> SharedRegions::Resolve(
    uint64_t id, absl::string_view key, absl::string_view principal) const {
  std::shared_ptr<SharedRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no shared memory region ", id,
                       " is registered (its client's connection closed, or it "
                       "never was)"));
    }
    region = it->second;
  }
  const absl::string_view own(reinterpret_cast<const char*>(region->key_.data()),
                              region->key_.size());
  if (!SameBytes(own, key) || !SameBytes(region->principal_, principal)) {
    return absl::PermissionDeniedError(
        absl::StrCat("shared memory region ", id, " belongs to another client"));
  }
  return region;
}

}  // namespace losshead::server
