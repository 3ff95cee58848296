#include "shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "losshead/client/status.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::client {

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Register(
    const std::string& socket, const std::string& authorization, size_t bytes) {
  // Whole pages: the mapping is of pages anyway.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  bytes = (bytes + page - 1) / page * page;
  transport::OwnedFd memfd(::memfd_create("losshead-step", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (memfd.get() < 0) {
    return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  // Sealed before anyone else sees it: its size can never change, so neither side can be made
  // to fault by the other truncating it.
  if (::ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::UnavailableError(
        absl::StrCat("sizing and sealing a memfd of ", bytes, " bytes: ", std::strerror(errno)));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("mmap of ", bytes, " bytes: ", std::strerror(errno)));
  }
  std::unique_ptr<SharedRegion> region(new SharedRegion());
  region->base_ = static_cast<std::byte*>(base);
  region->size_ = bytes;
  absl::StatusOr<transport::OwnedFd> connection = transport::ConnectSeqpacket(socket);
  if (!connection.ok()) return connection.status();
  region->connection_ = *std::move(connection);
  v1::SharedMemoryRegister request;
  request.set_authorization(authorization);
  request.set_bytes(bytes);
  if (absl::Status sent = transport::SendWithFd(region->connection_.get(),
                                                request.SerializeAsString(), memfd.get());
      !sent.ok()) {
    return sent;
  }
  absl::StatusOr<transport::FdMessage> reply =
      transport::ReceiveWithFd(region->connection_.get(), 4096);
  if (!reply.ok()) return reply.status();
  v1::SharedMemoryRegistered answer;
  if (reply->closed || !answer.ParseFromString(reply->bytes)) {
    return absl::UnavailableError("the server's same-node socket closed without an answer");
  }
  if (answer.code() != 0) return FromCodeAndMessage(answer.code(), answer.message());
  region->id_ = answer.region_id();
  region->key_ = answer.region_key();
  return region;
}

SharedRegion::~SharedRegion() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

}  // namespace losshead::client
