#include "losshead/kernels/backend.h"

#include "kernels/cpu/cpu_backend.h"
#ifdef LOSSHEAD_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace losshead::kernels {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = other.owner_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

bool CudaAvailable() {
#ifdef LOSSHEAD_HAVE_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind, int device) {
  switch (kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend();
    case BackendKind::kCuda:
#ifdef LOSSHEAD_HAVE_CUDA
      return CreateCudaBackend(device);
#else
      return absl::UnavailableError("this build of losshead has no CUDA backend");
#endif
    case BackendKind::kAuto:
      if (CudaAvailable()) return CreateBackend(BackendKind::kCuda, device);
      return CreateCpuBackend();
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

}  // namespace losshead::kernels
