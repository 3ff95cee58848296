// The output bias's gradient (Arguments::grad_bias, problem.h) from a chunk's G: column sums in a
// fixed order, so that reruns give the same bits.
#ifndef LOSSHEAD_KERNELS_CUDA_COLUMN_SUMS_CUH_
#define LOSSHEAD_KERNELS_CUDA_COLUMN_SUMS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

// out[j] += (sum_r g[r * ldg + j]) * *alpha / divisor for j in [0, v), r in [0, rows): each column
// summed in fp32 by one thread in row order (no atomics), alpha a device scalar (the reduction's
// scale, or 1 for a G that carries it), divisor the logit scale G carries (dloss/db_j is dloss/dx_j,
// G the gradient of u_j = x_j / scale). TG: float, __nv_bfloat16 or __half.
template <typename TG>
absl::Status LaunchAddColumnSums(const TG* g, int64_t ldg, int64_t rows, int64_t v,
                                 const float* alpha, float divisor, float* out,
                                 cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_COLUMN_SUMS_CUH_
