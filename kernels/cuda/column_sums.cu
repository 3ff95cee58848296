#include "kernels/cuda/column_sums.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/row_vec.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per column; a warp reads 32 neighbouring columns of a row at a time.
template <typename TG>
__global__ void __launch_bounds__(kThreads)
    AddColumnSumsKernel(const TG* __restrict__ g, int64_t ldg, int64_t rows, int64_t v,
                        const float* __restrict__ alpha, float divisor, float* __restrict__ out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= v) return;
  float sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) sum += ToF(g[r * ldg + j]);
  out[j] += sum * *alpha / divisor;
}

}  // namespace

template <typename TG>
absl::Status LaunchAddColumnSums(const TG* g, int64_t ldg, int64_t rows, int64_t v,
                                 const float* alpha, float divisor, float* out,
                                 cudaStream_t stream) {
  if (rows <= 0 || v <= 0) return absl::OkStatus();
  const auto blocks = static_cast<unsigned>((v + kThreads - 1) / kThreads);
  AddColumnSumsKernel<TG><<<blocks, kThreads, 0, stream>>>(g, ldg, rows, v, alpha, divisor, out);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

template absl::Status LaunchAddColumnSums<float>(const float*, int64_t, int64_t, int64_t,
                                                 const float*, float, float*, cudaStream_t);
template absl::Status LaunchAddColumnSums<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                         int64_t, const float*, float, float*,
                                                         cudaStream_t);
template absl::Status LaunchAddColumnSums<__half>(const __half*, int64_t, int64_t, int64_t,
                                                  const float*, float, float*, cudaStream_t);

}  // namespace losshead::kernels::cuda
