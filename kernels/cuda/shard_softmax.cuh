// The row kernels of a vocabulary shard (shard_problem.h): per-token statistics over the shard's
// columns, their combination over every shard into the token's lse, loss and logit gradient (with
// the model options and loss terms where asked for), and the rounding of the summed dH partials to
// the input dtype.
#ifndef LOSSHEAD_KERNELS_CUDA_SHARD_SOFTMAX_CUH_
#define LOSSHEAD_KERNELS_CUDA_SHARD_SOFTMAX_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/loss_math.h"
#include "kernels/cuda/softmax_grad.cuh"

namespace losshead::kernels::cuda {

struct ShardRowParams {
  int64_t v = 0;          // the whole vocabulary (label smoothing's eps / V, valid targets)
  int64_t row_begin = 0;  // the shard's first row: local column j is class row_begin + j
  int64_t rows = 0;       // the shard's columns per token
  int64_t ignore_index = -100;
  loss::Options loss;  // the loss options, handed to loss_math.h's formula as they are
  // Device pointer to a factor LaunchShardGrad multiplies the gradient by before it rounds it to
  // TG (a gradient stash keeps G scaled); null: the gradient is written unscaled.
  const float* grad_scale = nullptr;
};

// For each of `tokens` rows q (row q of `logits` starts at q * ldl elements; ldl a multiple of 16,
// `logits` 16-byte aligned) holding the shard's x_j = h . w_j, j in [0, p.rows), rounded to TL:
// writes the shard's statistics of token q over z_j = softcap(x_j) to `stats` (this shard's
// slice: statistic s at stats[s * stride + q]): max z, sum exp(z - max), sum z, and z of the
// target when the target (targets[q]) is one of the shard's rows and not ignore_index, else 0.
// Reads the logits only. Block reductions in a fixed order: a rerun gives the same bits.
// When `output_stats` is not null (this shard's slice of ShardArguments::output_stats, laid out
// as shard_problem.h describes it, stride `stride`), also the distribution outputs' statistics:
// s against the shard's max, its argmax's global id and, with top_k > 0, its top_k candidates;
// otherwise the plain kernel runs, as it did without them.
// With `terms` on (RowTerms::Any; its bias over the shard's rows, by local column), an
// instantiation of its own takes z_j = softcap(logit_scale x_j + bias_j) instead; a launch without
// them runs the kernels above unchanged.
// TL: float or __nv_bfloat16.
template <typename TL>
absl::Status LaunchShardStats(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                              const ShardRowParams& p, float* stats, int64_t stride,
                              cudaStream_t stream, float* output_stats = nullptr, int top_k = 0,
                              const RowTerms& terms = {});

// For each of `tokens` rows q: combines the `shards` slices of `stats` (slice r at
// stats + r * 4 * stride, laid out as above) in rank order into the token's lse and loss, and
// writes lse to per_token_lse[q] (optional, every row), the loss to row_loss[q] and
// per_token_loss[q] (optional; 0 for ignored rows). When `grad` is not null, overwrites the row's
// logits with the gradient dloss/dx_j for the shard's columns (0 for ignored rows), times
// *p.grad_scale where given, at grad[q * ldg + j], z_j recomputed from x_j as LaunchShardStats
// computed it. `grad` either aliases `logits` row for row (ldg * sizeof(TG) == ldl * sizeof(TL)),
// narrowing the row in place when TG is smaller than TL, or is memory of its own (a gradient
// stash's rows; ldg a multiple of 16, `grad` 16-byte aligned). A target outside [0, v) that is not
// ignore_index is treated as ignored.
// (TL, TG): (float, float), (float, __nv_bfloat16), (float, __half) or
// (__nv_bfloat16, __nv_bfloat16).
// When `outputs` asks for any distribution output (RowOutputs, rows from the chunk's first),
// also combines every shard's slice of `output_stats` (ShardOutputStatsRows(top_k) rows each, top_k
// the candidates exchanged) in rank order, in double, into them; otherwise the plain kernel runs.
// With `terms` on (RowTerms::Any; the bias by local column, the per-token inputs from the chunk's
// first token, as LaunchShardStats took them), an instantiation of its own forms each counted
// token's loss from the combined statistics with the terms (loss_math.h's TermsLossOf, in double;
// the entropy term's entropy combined from `output_stats`, which it then needs whatever `outputs`
// asks for) and writes the weighted loss, and the gradient of u_j = h . w_j: dloss/dx_j times the
// token's weight and logit_scale (then *p.grad_scale), z_j recomputed with the scale and bias.
template <typename TL, typename TG>
absl::Status LaunchShardGrad(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                             const ShardRowParams& p, const float* stats, int64_t stride,
                             int shards, TG* grad, int64_t ldg, float* row_loss,
                             float* per_token_loss, float* per_token_lse, cudaStream_t stream,
                             const float* output_stats = nullptr, int top_k = 0,
                             const RowOutputs& outputs = {}, const RowTerms& terms = {});

// dst[i] = src[i] rounded to T (round to nearest even) for i in [0, count). T: __nv_bfloat16 or
// __half (an fp32 store is a plain copy).
template <typename T>
absl::Status LaunchRoundToDType(const float* src, T* dst, int64_t count, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SHARD_SOFTMAX_CUH_
