// device_ipc.h with CUDA: cudaIpcOpenMemHandle / cudaIpcCloseMemHandle, copies on a stream of
// the mapping's own. The allocation's extent comes from the driver (cuMemGetAddressRange, found
// through the runtime's entry points so that the server links no driver library).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

// CopyIn's page-locked staging (device_ipc.h): at most kStagingBuffers of kStagingBytes in the
// process, allocated when first needed (portable: pinned for every device) and kept for reuse.
class Staging {
 public:
  // Up to `want` buffers, fewer or none once the bound is reached; given back by the destructor.
  explicit Staging(int want) {
    absl::MutexLock lock(&mu_);
    while (static_cast<int>(held_.size()) < want) {
      if (!idle_.empty()) {
        held_.push_back(idle_.back());
        idle_.pop_back();
        continue;
      }
      if (allocated_ >= kStagingBuffers) break;
      void* buffer = nullptr;
      if (cudaHostAlloc(&buffer, kStagingBytes, cudaHostAllocPortable) != cudaSuccess) {
        (void)cudaGetLastError();
        break;
      }
      ++allocated_;
      held_.push_back(buffer);
    }
  }
  ~Staging() {
    absl::MutexLock lock(&mu_);
    idle_.insert(idle_.end(), held_.begin(), held_.end());
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  size_t size() const { return held_.size(); }
  char* operator[](size_t i) const { return static_cast<char*>(held_[i]); }

 private:
  static inline absl::Mutex mu_;
  static inline std::vector<void*> idle_ ABSL_GUARDED_BY(mu_);
  static inline int allocated_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<void*> held_;
};

// Events without timing for a copy's pieces, destroyed with it.
class Events {
 public:
  explicit Events(int n) : events_(n, nullptr) {
    for (cudaEvent_t& e : events_) {
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        e = nullptr;
        ok_ = false;
      }
    }
  }
  ~Events() {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;

  bool ok() const { return ok_; }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
  bool ok_ = true;
};

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

absl::Status DeviceMapping::CopyOutPieces(void* host_dst, uint64_t offset, uint64_t bytes,
                                          absl::FunctionRef<void(uint64_t end)> landed) const {
  if (bytes == 0) return absl::OkStatus();
  cudaSetDevice(device_);  // before the events: an event is recorded only on its device's streams
  Events done(2);
  if (!done.ok()) {
    if (absl::Status s = CopyOut(host_dst, offset, bytes); !s.ok()) return s;
    landed(bytes);
    return absl::OkStatus();
  }
  auto stream = static_cast<cudaStream_t>(stream_);
  auto* dst = static_cast<char*>(host_dst);
  const uint64_t pieces = (bytes + kCopyPieceBytes - 1) / kCopyPieceBytes;
  // Piece i's completion is event i % 2; at most two pieces are queued: while piece i lands and
  // is handed over, piece i + 1's DMA runs.
  auto enqueue = [&](uint64_t i) {
    const uint64_t at = i * kCopyPieceBytes;
    const uint64_t n = std::min(kCopyPieceBytes, bytes - at);
    cudaError_t e = cudaMemcpyAsync(dst + at, data_ + offset + at, n, cudaMemcpyDefault, stream);
    if (e == cudaSuccess) e = cudaEventRecord(done[i % 2], stream);
    return e;
  };
  cudaError_t e = enqueue(0);
  for (uint64_t i = 0; i < pieces && e == cudaSuccess; ++i) {
    if (i + 1 < pieces) e = enqueue(i + 1);
    if (e == cudaSuccess) e = cudaEventSynchronize(done[i % 2]);
    if (e == cudaSuccess) landed(std::min(bytes, (i + 1) * kCopyPieceBytes));
  }
  if (e != cudaSuccess) {
    cudaStreamSynchronize(stream);  // nothing may still write into host_dst
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
  const auto* src = static_cast<const char*>(host_src);
  cudaError_t e = cudaSuccess;
  {
    // Both go at the end of this block, after the stream is drained (below); the events on the
    // mapping's device, current now.
    Events done(2);
    Staging staging(2);
    if (staging.size() < 2 || !done.ok()) {
      // No staging free: from ordinary memory, staged by the driver.
      e = cudaMemcpyAsync(data_ + offset, src, bytes, cudaMemcpyDefault, stream);
    } else {
      // Piece i goes through buffer i % 2: its host copy runs while piece i - 1's DMA does.
      for (uint64_t at = 0, i = 0; at < bytes && e == cudaSuccess; at += kStagingBytes, ++i) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kStagingBytes, bytes - at));
        const size_t b = i % 2;
        if (i >= 2) e = cudaEventSynchronize(done[b]);  // the buffer's last DMA has finished
        if (e != cudaSuccess) break;
        std::memcpy(staging[b], src + at, n);
        e = cudaMemcpyAsync(data_ + offset + at, staging[b], n, cudaMemcpyDefault, stream);
        if (e == cudaSuccess) e = cudaEventRecord(done[b], stream);
      }
    }
    // Always drained, so that no DMA still reads a staging buffer given back.
    const cudaError_t drained = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = drained;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("copying ", bytes, " bytes into a device region: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
