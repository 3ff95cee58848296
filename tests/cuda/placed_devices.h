// The CUDA backends a placed head runs on in the GPU suite: k devices, or k ranks of device 0
// (joined by the staged collective rather than NCCL).
#ifndef LOSSHEAD_TESTS_CUDA_PLACED_DEVICES_H_
#define LOSSHEAD_TESTS_CUDA_PLACED_DEVICES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"

namespace losshead::testing {

// Why a test of k ranks must skip here; "" when enough GPUs are visible.
inline std::string TooFewGpus(int k, bool one_gpu) {
  const int needed = one_gpu ? 1 : k;
  if (kernels::CudaDeviceCount() >= needed) return "";
  return absl::StrCat("needs ", needed, " CUDA devices, ", kernels::CudaDeviceCount(), " visible");
}

// k CUDA backends, rank r on device r, or every rank on device 0 when `one_gpu`.
inline absl::StatusOr<std::vector<std::unique_ptr<kernels::Backend>>> PlacedBackends(int k,
                                                                                     bool one_gpu) {
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  for (int r = 0; r < k; ++r) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCuda, one_gpu ? 0 : r);
    if (!backend.ok()) return backend.status();
    backends.push_back(std::move(*backend));
  }
  return backends;
}

inline std::vector<kernels::Backend*> Pointers(
    const std::vector<std::unique_ptr<kernels::Backend>>& backends) {
  std::vector<kernels::Backend*> out;
  for (const auto& backend : backends) out.push_back(backend.get());
  return out;
}

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_CUDA_PLACED_DEVICES_H_
