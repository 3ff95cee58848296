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
  // Each row's log-sum-exp of columns [0, stats_width) per 256 columns, as the logits GEMM of
  // logits_gemm_sm90.cuh leaves them (row r's at tile_stats + r * stats_ld; stats_ld >=
  // LogitsTileCount(stats_width)), or null. With them the lse is theirs folded with the columns
  // past stats_width: the plain kernel then reads the row once (for the gradient) instead of
  // twice, and the distribution outputs' kernels read it for their own statistics only, so that
  // the lse, the loss and the gradient are the same bits with or without them. bf16 logits only,
  // of a loss that takes them as they are: no soft-cap, label smoothing or terms
  // (INVALID_ARGUMENT otherwise).
  const float* tile_stats = nullptr;
  int64_t stats_width = 0;
  int64_t stats_ld = 0;
};

// The distribution outputs (problem.h) of one launch's rows, each optional, at the launch's row r
// (the top-k at r * top_k): a launch that asks for none runs the plain kernel, one that asks for
// any runs an instantiation that carries the entropy's and the argmax's statistics through the
// row's reduction (reduce.cuh's SoftmaxState<false, true>), and one that asks for the top-k also
// a per-thread candidate list. An ignored row gets 0, 0, -1 and ids -1 / log-probs 0.
struct RowOutputs {
  float* logprob = nullptr;
  float* entropy = nullptr;
  int32_t* argmax = nullptr;
  // += the launch's counted rows whose argmax is their target (an atomic integer sum: the same
  // total whatever the order). The caller zeroes it before the run's first launch.
  unsigned long long* correct_count = nullptr;
  int top_k = 0;  // [1, kMaxTopK] with top_k_ids or top_k_logprobs
  int32_t* top_k_ids = nullptr;
  float* top_k_logprobs = nullptr;

  __host__ __device__ bool TopK() const {
    return top_k > 0 && (top_k_ids != nullptr || top_k_logprobs != nullptr);
  }
  __host__ __device__ bool Any() const {
    return logprob != nullptr || entropy != nullptr || argmax != nullptr ||
           correct_count != nullptr || TopK();
  }
};

// The model options and loss terms of a launch's rows (problem.h; loss_math.h's TermOptions), the
// per-token inputs at the launch's row r, bias by class. A launch with none of them on (Any())
// runs the kernels above unchanged; one with any runs an instantiation of its own that applies the
// scale and bias to x before the soft-cap, carries the entropy's statistic through the reduction
// (as RowOutputs does), and writes the gradient of u = h . w_j (the scale, the weight and the
// terms' own gradients folded in), so that the GEMMs that read it are the plain ones.
struct RowTerms {
  loss::TermOptions terms;
  const float* bias = nullptr;           // V fp32
  const float* token_weights = nullptr;  // by row
  const float* old_logprob = nullptr;    // by row; policy gradient only
  const float* advantages = nullptr;     // by row; policy gradient only
  const float* ref_logprob = nullptr;    // by row; when kl_coef > 0

  bool Any() const { return loss::AnyTerm(terms) || bias != nullptr || token_weights != nullptr; }
};

#ifdef __CUDACC__
// An ignored row's distribution outputs (problem.h), by one thread.
__device__ __forceinline__ void WriteIgnoredOutputs(const RowOutputs& out, int64_t row) {
  if (out.logprob != nullptr) out.logprob[row] = 0.0f;
  if (out.entropy != nullptr) out.entropy[row] = 0.0f;
  if (out.argmax != nullptr) out.argmax[row] = -1;
  if (!out.TopK()) return;
  for (int i = 0; i < out.top_k; ++i) {
    if (out.top_k_ids != nullptr) out.top_k_ids[row * out.top_k + i] = -1;
    if (out.top_k_logprobs != nullptr) out.top_k_logprobs[row * out.top_k + i] = 0.0f;
  }
}
#endif

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
// The distribution outputs asked for in `outputs` (RowOutputs) are written as problem.h defines
// them; the other outputs are the same bits whether or not any is asked for. With `terms` on
// (RowTerms::Any), the loss is the weighted loss of problem.h's terms and the gradient that of
// u_j = h . w_j: dloss/dx_j times the token's weight and logit_scale (then *params.grad_scale).
// TL, TG: float, __nv_bfloat16 or __half (see the instantiations in the .cu). launch.threads: 512
// or 1024 (INVALID_ARGUMENT otherwise).
template <typename TL, typename TG>
absl::Status LaunchSoftmaxGrad(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                               const SoftmaxGradParams& params, TG* grad, int64_t ldg,
                               float* row_loss, float* per_token_loss, float* per_token_lse,
                               const RowLaunch& launch, cudaStream_t stream,
                               const RowOutputs& outputs = {}, const RowTerms& terms = {});

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SOFTMAX_GRAD_CUH_
