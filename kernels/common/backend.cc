#include "losshead/kernels/backend.h"

#include "kernels/cpu/cpu_backend.h"
#ifdef LOSSHEAD_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace losshead::kernels {

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
