#include "losshead/client/device_region.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "losshead/client/status.h"
#include "losshead/v1/losshead.pb.h"
#include "transport/fd_socket.h"

namespace losshead::client {

absl::StatusOr<std::shared_ptr<DeviceRegion>> DeviceRegion::Register(
    const std::string& socket, const std::string& authorization, std::string_view ipc_handle,
    uint64_t offset, uint64_t bytes, const std::string& pci_bus_id) {
  std::shared_ptr<DeviceRegion> region(new DeviceRegion());
  absl::StatusOr<transport::OwnedFd> connection = transport::ConnectSeqpacket(socket);
  if (!connection.ok()) return connection.status();
  region->connection_ = connection->release();
  v1::SharedMemoryRegister request;
  request.set_authorization(authorization);
  request.set_bytes(bytes);
  request.set_kind(v1::REGION_KIND_DEVICE);
  request.set_device_handle(std::string(ipc_handle));
  request.set_device_offset(offset);
  request.set_device_pci_bus_id(pci_bus_id);
  if (absl::Status sent =
          transport::SendWithFd(region->connection_, request.SerializeAsString(), -1);
      !sent.ok()) {
    return sent;
  }
  absl::StatusOr<transport::FdMessage> reply = transport::ReceiveWithFd(region->connection_, 4096);
  if (!reply.ok()) return reply.status();
  v1::SharedMemoryRegistered answer;
  if (reply->closed || !answer.ParseFromString(reply->bytes)) {
    return absl::UnavailableError("the server's same-node socket closed without an answer");
  }
  if (answer.code() != 0) return FromCodeAndMessage(answer.code(), answer.message());
  region->size_ = bytes;
  region->id_ = answer.region_id();
  region->key_ = answer.region_key();
  return region;
}

DeviceRegion::~DeviceRegion() {
  if (connection_ >= 0) ::close(connection_);
}

}  // namespace losshead::client
