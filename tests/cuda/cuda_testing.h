// What every CUDA kernel suite needs first: a skip on machines without a GPU, and a backend on
// device 0.
#ifndef LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_
#define LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_

#include <memory>
#include <utility>

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

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_CUDA_CUDA_TESTING_H_
