// Deterministic sum of squares of an fp32 buffer, in fp64.
#ifndef LOSSHEAD_KERNELS_CUDA_SQUARED_NORM_CUH_
#define LOSSHEAD_KERNELS_CUDA_SQUARED_NORM_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

// Per-block partial sums the reduction needs: `partials` must hold this many doubles.
inline constexpr int kSquaredNormPartials = 4096;

// *result = sum of data[i]^2 over [0, count). A fixed grid of kSquaredNormPartials blocks writes
// one fp64 partial each, in an order fixed by `count` alone (not by the device or the buffer's
// alignment), then one block adds the partials in a fixed tree: no atomics, so a rerun gives the
// same bits.
absl::Status LaunchSquaredNorm(const float* data, int64_t count, double* partials, double* result,
                               cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SQUARED_NORM_CUH_
