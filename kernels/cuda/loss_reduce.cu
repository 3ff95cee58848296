#include "kernels/cuda/loss_reduce.cuh"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
    LossReduceKernel(const float* __restrict__ row_loss, int64_t rows,
                     RunScalars* __restrict__ scalars, float* __restrict__ loss_sum) {
  __shared__ double warp_sums[kThreads / kWarpSize];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) sum += row_loss[i];
  ReduceToWarpSlots<kThreads>(sum, SumOp{}, warp_sums);
  if (threadIdx.x == 0) {
    // Onto the accumulator, warp by warp: the order every earlier chunk's loss was added in.
    const double total = FoldWarpSlots<kThreads>(warp_sums, SumOp{}, scalars->loss_acc);
    scalars->loss_acc = total;
    if (loss_sum != nullptr) *loss_sum = static_cast<float>(total);
  }
}

}  // namespace

absl::Status LaunchLossReduce(const float* row_loss, int64_t rows, RunScalars* scalars,
                              float* loss_sum, cudaStream_t stream) {
  LossReduceKernel<<<1, kThreads, 0, stream>>>(row_loss, rows, scalars, loss_sum);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
