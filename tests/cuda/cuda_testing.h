// What every CUDA kernel suite needs first: a skip on machines without a GPU, a backend on
// device 0, and host vectors to and from device memory for the suites that call kernels directly.
#ifndef LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_
#define LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"

// Skips the test (with the reason) where no CUDA device is visible.
#define SKIP_WITHOUT_GPU()                         \
  if (::losshead::kernels::CudaDeviceCount() == 0) \
  GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

namespace losshead::kernels::testing {

// A CUDA backend on device 0, or null after a failed expectation.
inline std::unique_ptr<Backend> MakeCuda(const CudaBackendOptions& options = {}) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0, options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// A device copy of `host` (cudaMalloc'd: the caller frees it), or null after a failed expectation.
template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return p;
}

// `count` elements at `p`, on the host.
template <typename T>
std::vector<T> ToHost(const T* p, int64_t count) {
  std::vector<T> out(count);
  EXPECT_EQ(cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_
