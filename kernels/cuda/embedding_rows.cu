#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/embedding_rows.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Rows are walked grid-stride: enough blocks to fill any device, and no grid limit on n.
constexpr int64_t kMaxBlocks = 65535;

template <typename Bits>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const Bits* __restrict__ weights, int64_t d, const int64_t* __restrict__ ids,
                     int64_t n, Bits* __restrict__ out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const Bits* src = weights + ids[i] * d;
    Bits* dst = out + i * d;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) dst[j] = src[j];
  }
}

__global__ void __launch_bounds__(kThreads)
    IndexAddRowsKernel(const float* __restrict__ values, const int64_t* __restrict__ ids, int64_t n,
                       int64_t d, float* __restrict__ grad) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = ids[i];
    if (i > 0 && ids[i - 1] == id) continue;  // not the first of its run
    int64_t last = i + 1;
    while (last < n && ids[last] == id) ++last;
    float* target = grad + id * d;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      float sum = values[i * d + j];
      for (int64_t k = i + 1; k < last; ++k) sum += values[k * d + j];
      target[j] += sum;
    }
  }
}

int Blocks(int64_t n) { return static_cast<int>(std::min<int64_t>(n, kMaxBlocks)); }

}  // namespace

absl::Status LaunchGatherRows(const void* weights, size_t element_bytes, int64_t d,
                              const int64_t* ids, int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  if (element_bytes == 2) {
    GatherRowsKernel<uint16_t><<<Blocks(n), kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(weights), d, ids, n, static_cast<uint16_t*>(out));
  } else {
    GatherRowsKernel<uint32_t><<<Blocks(n), kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(weights), d, ids, n, static_cast<uint32_t*>(out));
  }
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

absl::Status LaunchIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                                float* grad, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  IndexAddRowsKernel<<<Blocks(n), kThreads, 0, stream>>>(values, ids, n, d, grad);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
