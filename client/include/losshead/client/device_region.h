// A device region registered with a server on this host (docs/same-node.md, "The device path"):
// a CUDA allocation of the caller's, named by its IPC handle, that the server opens on one of its
// devices and copies hidden states and targets out of, and dH into. The client library has no
// CUDA: the caller makes the handle (cudaIpcGetMemHandle, or torch's storage._share_cuda_())
// and owns the memory, which must outlive this object.
//
// Invariants:
// - The server keeps the allocation open exactly as long as this object's connection to its
//   same-node socket: destroying the object (or this process dying) closes it there.
// - Ordering: the caller finishes every write of the micro-batch's hidden states and targets
//   (synchronises the stream that wrote them) before sending it, and reads dH only once its
//   answer is received: the server has synchronised its copy into the region before answering.
#ifndef LOSSHEAD_CLIENT_DEVICE_REGION_H_
#define LOSSHEAD_CLIENT_DEVICE_REGION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace losshead::client {

// A server device where device regions open (Stats.same_node.devices).
struct SameNodeDevice {
  int index = 0;
  std::string pci_bus_id;  // "dddd:bb:dd.f", lower case
};

class DeviceRegion {
 public:
  // Registers [offset, offset + bytes) of the allocation of `ipc_handle` (the 64 bytes of a
  // cudaIpcMemHandle_t), which lies on the device of `pci_bus_id`, on the same-node `socket` with
  // `authorization` ("Bearer <token>" or empty). The server's refusal comes back with its code
  // (FAILED_PRECONDITION: a server without CUDA devices, or whose devices cannot reach it).
  static absl::StatusOr<std::shared_ptr<DeviceRegion>> Register(const std::string& socket,
                                                                const std::string& authorization,
                                                                std::string_view ipc_handle,
                                                                uint64_t offset, uint64_t bytes,
                                                                const std::string& pci_bus_id);
  ~DeviceRegion();  // closes the connection: the server closes its handle
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;

  uint64_t size() const { return size_; }
  uint64_t id() const { return id_; }
  const std::string& key() const { return key_; }

 private:
  DeviceRegion() = default;
  uint64_t size_ = 0;
  uint64_t id_ = 0;
  std::string key_;
  int connection_ = -1;  // to the server's same-node socket
};

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_DEVICE_REGION_H_
