// CUDA IPC for the same-node device path (docs/same-node.md, "The device path"): a client's
// device allocation, shared through its cudaIpcMemHandle_t, opened on one of the server's devices
// and copied from and into there. Built against CUDA where the build has it (device_ipc_cuda.cc),
// else as refusals (device_ipc_none.cc): a server without CUDA offers no devices and refuses
// every device region FAILED_PRECONDITION.
//
// Invariants:
// - A mapping is open exactly as long as its object lives: the destructor closes the handle
//   (cudaIpcCloseMemHandle), so a region dropped with its connection leaves nothing open.
// - [0, size()) lies inside the client's allocation (checked against the allocation's extent at
//   Open): no copy through a mapping reaches memory outside what the client shared.
// - Copies are synchronous: when CopyOut returns, the bytes are in host memory and the client's
//   buffer is no longer read; when CopyIn returns, they are in the client's buffer. They run on
//   the mapping's own non-blocking stream, from any thread (each waits for its own copies).
// - CopyIn from ordinary memory goes through page-locked staging: at most kStagingBuffers of
//   kStagingBytes in the process (64 MiB), allocated when first needed and kept, two per copy
//   while it runs; a copy that finds none free goes from ordinary memory (the driver stages it).
#ifndef LOSSHEAD_SERVER_RPC_DEVICE_IPC_H_
#define LOSSHEAD_SERVER_RPC_DEVICE_IPC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace losshead::server {

// The size of a cudaIpcMemHandle_t.
inline constexpr size_t kDeviceIpcHandleBytes = 64;
// The pieces of CopyOutPieces: large enough for the bus rate, small enough that the first to
// land is soon there to digest.
inline constexpr uint64_t kCopyPieceBytes = uint64_t{4} << 20;
// CopyIn's page-locked staging (see above): the bound on what the process keeps.
inline constexpr size_t kStagingBytes = size_t{4} << 20;
inline constexpr int kStagingBuffers = 16;

struct IpcDevice {
  int index = 0;           // the device ordinal
  std::string pci_bus_id;  // "dddd:bb:dd.f", lower case
};

// The devices among `ordinals` where this build can open device regions, with their PCI bus ids
// (empty without CUDA, or when the driver answers nothing).
std::vector<IpcDevice> DescribeIpcDevices(const std::vector<int>& ordinals);

class DeviceMapping {
 public:
  // Opens the allocation of `handle` (kDeviceIpcHandleBytes) on the device of `devices` whose
  // bus id is `pci_bus_id`, else on the first of them (with peer access enabled lazily), and
  // keeps [offset, offset + bytes) of it. FAILED_PRECONDITION: no devices (a build without CUDA,
  // or a server on CPUs); INVALID_ARGUMENT: a handle of another size, one that does not open
  // (another process's memory that is gone, not an IPC handle, a device the server cannot
  // reach), `bytes` 0 or a range past the allocation's end. Nothing stays open on a refusal.
  static absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const std::vector<IpcDevice>& devices,
                                                             absl::string_view handle,
                                                             uint64_t offset, uint64_t bytes,
                                                             absl::string_view pci_bus_id);
  ~DeviceMapping();
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;

  uint64_t size() const { return bytes_; }
  int device() const { return device_; }  // the ordinal it was opened on
  // [offset, offset + bytes) in this process's address space: device memory, for copies a device
  // makes into it (kernels::Backend::CopyOnDevice; unified addressing finds its device).
  void* data() const { return data_; }
  // Copies [offset, offset + bytes) of the region into host memory, and waits.
  absl::Status CopyOut(void* host_dst, uint64_t offset, uint64_t bytes) const;
  // The same in pieces of kCopyPieceBytes, one after another: `landed(end)` is called, in order
  // and on this thread, once [0, end) of `host_dst` holds its bytes, while the next piece's DMA
  // runs (so that the bytes are digested and checked as they land). When it returns, no copy
  // writes into `host_dst` any more, on error too.
  absl::Status CopyOutPieces(void* host_dst, uint64_t offset, uint64_t bytes,
                             absl::FunctionRef<void(uint64_t end)> landed) const;
  // Copies host memory into [offset, offset + bytes) of the region, and waits: from ordinary
  // memory in pieces of kStagingBytes through two staging buffers, each piece copied into one
  // while the other's DMA runs.
  absl::Status CopyIn(uint64_t offset, const void* host_src, uint64_t bytes) const;

 private:
  DeviceMapping() = default;
  void* base_ = nullptr;     // what cudaIpcOpenMemHandle answered (the allocation's start)
  uint8_t* data_ = nullptr;  // base_ + offset
  uint64_t bytes_ = 0;
  int device_ = -1;
  void* stream_ = nullptr;  // a cudaStream_t of the mapping's own, non-blocking
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_DEVICE_IPC_H_
