#include "kernels/cuda/count_targets.cuh"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads)
    CountTargetsKernel(const int32_t* __restrict__ targets, int64_t n, int64_t v,
                       int64_t ignore_index, bool mean, float grad_scale,
                       int64_t* __restrict__ token_count, RunScalars* __restrict__ scalars) {
  long long count = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t t = targets[i];
    count += (t != ignore_index && t >= 0 && t < v) ? 1 : 0;
  }
  const long long total = BlockReduce<kThreads>(count, SumOp{}, 0LL);
  if (threadIdx.x == 0) {
    if (token_count != nullptr) *token_count = total;
    scalars->one = 1.0f;
    scalars->zero = 0.0f;
    scalars->grad_alpha =
        mean ? (total > 0 ? static_cast<float>(static_cast<double>(grad_scale) / total) : 0.0f)
             : grad_scale;
    scalars->unused = 0.0f;
    scalars->loss_acc = 0.0;
  }
}

}  // namespace

absl::Status LaunchCountTargets(const int32_t* targets, int64_t n, int64_t v, int64_t ignore_index,
                                bool mean, float grad_scale, int64_t* token_count,
                                RunScalars* scalars, cudaStream_t stream) {
  CountTargetsKernel<<<1, kThreads, 0, stream>>>(targets, n, v, ignore_index, mean, grad_scale,
                                                 token_count, scalars);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
