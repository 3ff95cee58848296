#include "losshead/kernels/backend.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#ifdef LOSSHEAD_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace losshead::kernels {

int CudaDevices() {
#ifdef LOSSHEAD_HAVE_CUDA
  return CudaDeviceCount();
#else
  return 0;
#endif
}

bool CudaAvailable() { return CudaDevices() > 0; }

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

absl::StatusOr<std::vector<std::unique_ptr<Backend>>> CreateBackends(
    BackendKind kind, const std::vector<int>& devices) {
  if (kind == BackendKind::kAuto) kind = CudaAvailable() ? BackendKind::kCuda : BackendKind::kCpu;
  std::vector<int> ordinals = devices;
  if (ordinals.empty()) {
    const int count = kind == BackendKind::kCuda ? CudaDevices() : 1;
    for (int i = 0; i < std::max(count, 1); ++i) ordinals.push_back(i);
  }
  for (size_t i = 0; i < ordinals.size(); ++i) {
    if (ordinals[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ordinals must be >= 0, got ", ordinals[i]));
    }
    for (size_t j = 0; j < i; ++j) {
      if (ordinals[j] == ordinals[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("device ", ordinals[i], " is listed more than once"));
      }
    }
  }
  std::vector<std::unique_ptr<Backend>> backends;
  for (int ordinal : ordinals) {
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(kind, ordinal);
    if (!backend.ok()) return backend.status();
    backends.push_back(std::move(*backend));
  }
  return backends;
}

}  // namespace losshead::kernels
