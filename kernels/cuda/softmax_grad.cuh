// The fused row kernel of one token chunk: soft-cap, online softmax, lse, loss, and the logit
// gradient written over the logits it was computed from.
#ifndef LOSSHEAD_KERNELS_CUDA_SOFTMAX_GRAD_CUH_
#define LOSSHEAD_KERNELS_CUDA_SOFTMAX_GRAD_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/loss_math.h"

namespace losshead::kernels::cuda {

struct SoftmaxGradParams {
  int64_t v = 0;  // vocabulary size: columns [0, v) of each row are logits
  int64_t ignore_index = -100;
  loss::Options loss;  // the loss options, handed to loss_math.h's formula as they are
  // Device pointer to a factor the gradient is multiplied by before it is rounded to TG (the
  // gradient stash keeps G scaled); null: the gradient is written unscaled.
  const float* grad_scale = nullptr;
};

// How the row kernel is launched: `threads` per row (512 or 1024); when blocks_per_sm > 0, at
// most that many rows per SM at once (smem_per_sm: the device's shared memory per SM, used to
// enforce the cap), which bounds the rows in flight so that the second pass hits L2.
struct RowLaunch {
  int threads = 512;
  int blocks_per_sm = 0;
  size_t smem_per_sm = 0;
};

// For each of `rows` rows r (row r of `logits` starts at r * ldl elements; ldl a multiple of 16,
// `logits` 16-byte aligned), with target y = targets[r]:
//   writes lse to per_token_lse[r] (optional, every row), the loss to row_loss[r] and
//   per_token_loss[r] (optional; 0 for ignored rows), and, when `grad` is not null, the
//   gradient dloss/dx_j (LossOptions' g_j chained through the soft-cap, times *params.grad_scale
//   when set; 0 for ignored rows) to grad[r * ldg + j]. `grad` either aliases `logits` row for
//   row (ldg * sizeof(TG) == ldl * sizeof(TL)): the gradient overwrites the logits in place,
//   narrowing them when TG is smaller than TL; or lies wholly outside them (ldg a multiple of 16,
//   16-byte aligned rows). Unscaled, the reduction's scale is applied later, as the GEMMs' alpha.
// A target outside [0, v) that is not ignore_index is treated as ignored (no out-of-bounds access;
// the caller is expected to have rejected it already).
// TL, TG: float, __nv_bfloat16 or __half (see the instantiations in the .cu). launch.threads: 512
// or 1024 (INVALID_ARGUMENT otherwise).
template <typename TL, typename TG>
absl::Status LaunchSoftmaxGrad(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                               const SoftmaxGradParams& params, TG* grad, int64_t ldg,
                               float* row_loss, float* per_token_loss, float* per_token_lse,
                               const RowLaunch& launch, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SOFTMAX_GRAD_CUH_
