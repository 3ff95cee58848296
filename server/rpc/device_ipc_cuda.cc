// device_ipc.h with CUDA: cudaIpcOpenMemHandle / cudaIpcCloseMemHandle, copies on a stream of
// the mapping's own. The allocation's extent comes from the driver (cuMemGetAddressRange, found
// through the runtime's entry points so that the server links no driver library).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cctype>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/rpc/device_ipc.h"

namespace losshead::server {
namespace {

std::string BusId(int ordinal) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), ordinal) != cudaSuccess) return "";
  return absl::AsciiStrToLower(id);
}

// The [base, base + size) of the allocation `ptr` lies in, as the driver knows it.
absl::Status AllocationExtent(const void* ptr, uintptr_t* base, size_t* size) {
  using Range = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Range range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t got = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t got =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &found);
#endif
    if (got != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<Range>(fn);
  }();
  if (range == nullptr) return absl::InternalError("the driver has no cuMemGetAddressRange");
  CUdeviceptr b = 0;
  if (range(&b, size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("the opened handle's allocation has no extent");
  }
  *base = static_cast<uintptr_t>(b);
  return absl::OkStatus();
}

}  // namespace

std::vector<IpcDevice> DescribeIpcDevices(const std::vector<int>& ordinals) {
  std::vector<IpcDevice> out;
  for (int ordinal : ordinals) {
    std::string bus = BusId(ordinal);
    if (!bus.empty()) out.push_back({ordinal, std::move(bus)});
  }
  return out;
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> DeviceMapping::Open(
    const std::vector<IpcDevice>& devices, absl::string_view handle, uint64_t offset,
    uint64_t bytes, absl::string_view pci_bus_id) {
  if (devices.empty()) {
    return absl::FailedPreconditionError(
        "this server computes on no CUDA device: it opens no device regions (register a host "
        "region)");
  }
  if (handle.size() != kDeviceIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a device handle of ", handle.size(),
                                                   " bytes (a cudaIpcMemHandle_t has ",
                                                   kDeviceIpcHandleBytes, ")"));
  }
  if (bytes == 0) return absl::InvalidArgumentError("a device region of 0 bytes");
  // The device that holds the memory when it is one of the server's, else the first with peer
  // access to it (an NVLink or PCIe peer), else none.
  const std::string wanted = absl::AsciiStrToLower(pci_bus_id);
  int device = -1;
  for (const IpcDevice& d : devices) {
    if (d.pci_bus_id == wanted) device = d.index;
  }
  if (device < 0) {
    int owner = -1;
    if (!wanted.empty() && cudaDeviceGetByPCIBusId(&owner, wanted.c_str()) == cudaSuccess) {
      for (const IpcDevice& d : devices) {
        int can = 0;
        if (cudaDeviceCanAccessPeer(&can, d.index, owner) == cudaSuccess && can != 0) {
          device = d.index;
          break;
        }
      }
    }
    (void)cudaGetLastError();
    if (device < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", wanted.empty() ? "(unnamed)" : wanted,
                       " is none of this server's devices nor a peer of one: register a host "
                       "region"));
    }
  }
  if (cudaSetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", device, ") failed"));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* base = nullptr;
  const cudaError_t opened = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (opened != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("the device handle does not open on device ",
                                                   device, ": ", cudaGetErrorString(opened)));
  }
  auto mapping = std::unique_ptr<DeviceMapping>(new DeviceMapping());
  mapping->base_ = base;  // closed by the destructor from here on, refusals included
  mapping->device_ = device;
  uintptr_t start = 0;
  size_t extent = 0;
  if (absl::Status s = AllocationExtent(base, &start, &extent); !s.ok()) return s;
  const uint64_t from = reinterpret_cast<uintptr_t>(base) - start;
  if (offset > extent - from || bytes > extent - from - offset) {
    return absl::InvalidArgumentError(absl::StrCat("a device region [", offset, ", ", offset, " + ",
                                                   bytes, ") past the end of its allocation of ",
                                                   extent - from, " bytes"));
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError("no CUDA stream for a device region");
  }
  mapping->stream_ = stream;
  mapping->data_ = static_cast<uint8_t*>(base) + offset;
  mapping->bytes_ = bytes;
  return mapping;
}

DeviceMapping::~DeviceMapping() {
  if (base_ == nullptr) return;
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  cudaIpcCloseMemHandle(base_);
  (void)cudaGetLastError();
}

absl::Status DeviceMapping::CopyOut(void* host_dst, uint64_t offset, uint64_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  auto stream = static_cast<cudaStream_t>(stream_);
  cudaSetDevice(device_);
  cudaError_t e = cudaMemcpyAsync(host_dst, data_ + offset, bytes, cudaMemcpyDefault, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("copying ", bytes, " bytes out of a device region: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::Status DeviceMapping::CopyIn(uint64_t offset, const void* host_src, uint64_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  auto stream = static_cast<cudaStream_t>(stream_);
  cudaSetDevice(device_);
  cudaError_t e = cudaMemcpyAsync(data_ + offset, host_src, bytes, cudaMemcpyDefault, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("copying ", bytes, " bytes into a device region: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
