// The per-token halves of a vocabulary shard (see shard_problem.h): a row's statistics over the
// shard's columns, their combination over the shards, and the row's gradient from the global lse.
#ifndef LOSSHEAD_KERNELS_CPU_SHARD_ROWS_H_
#define LOSSHEAD_KERNELS_CPU_SHARD_ROWS_H_

#include <cstdint>

#include "kernels/cpu/row_terms.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels {

// Soft-caps the `rows` logits of one token in place (they then hold z) and returns its statistics
// over them: max, sum of exp(z - max), sum of z (the last two summed in double), and z at
// `local_target` (0 when it is outside [0, rows): another shard's row, or an ignored token).
struct ShardRowStats {
  float stats[kShardStats];
};
ShardRowStats ComputeShardRowStats(float* logits, int64_t rows, int64_t local_target,
                                   float softcap);

// A token's output statistics over the shard's `rows` columns of z (already soft-capped, as
// ComputeShardRowStats leaves them), as shard_problem.h lays out output_stats: written to
// out[i * stride] for statistic i; `top_k` 0 writes no candidates. Ids are global (row_begin + j).
void ComputeShardOutputStats(const float* z, int64_t rows, int64_t row_begin, int top_k, float* out,
                             int64_t stride);

// One token's distribution outputs (Arguments, problem.h) from every shard's statistics and
// output statistics (token q), combined in rank order in double: `lse` is CombineShardStats's.
// With top_k > 0, `top_ids` and `top_logprobs` (either may be null) receive the top_k.
struct ShardTokenOutputs {
  double logprob = 0.0;
  double entropy = 0.0;
  int32_t argmax = -1;
};
ShardTokenOutputs CombineShardOutputStats(const float* stats, const float* output_stats,
                                          int64_t stride, int shards, int64_t q, double lse,
                                          int top_k, int32_t* top_ids, float* top_logprobs);

// One token's lse and loss from every shard's statistics (`stats` as ShardArguments lays them
// out, token q), combined in rank order in double. `v` is the whole vocabulary. The loss of an
// ignored token is 0; its lse is still computed.
struct ShardTokenLoss {
  double lse = 0.0;
  double loss = 0.0;
  // The combined statistics the terms read (z of the target, the sum of z).
  double z_target = 0.0;
  double sum_z = 0.0;
};
ShardTokenLoss CombineShardStats(const float* stats, int64_t stride, int shards, int64_t q,
                                 bool ignored, const LossOptions& options, int64_t v);

// Overwrites one token's z row (`rows` columns) with grad_scale * dloss/dx_j for its columns:
// LossOptions' g_j from the global `lse`, the one-hot at `local_target` (none outside [0, rows)),
// eps / v with the whole vocabulary's v, chained through the soft-cap. Zeros for an ignored token.
void ComputeShardRowGradient(float* z, int64_t rows, int64_t local_target, bool ignored, double lse,
                             const LossOptions& options, int64_t v, float grad_scale);

// With the model options and terms on (row_terms.h): a counted token's weighted loss from the
// combined statistics (`token`, CombineShardStats's) and its entropy (CombineShardOutputStats's;
// read only with entropy_coef != 0), as ComputeRowLossWithTerms forms it on one device.
double ShardTermsLoss(const LossOptions& options, const ShardTokenLoss& token, int64_t v,
                      double entropy, const TokenTerms& inputs);

// And its row of G: z (after scale, bias and soft-cap) overwritten with
// grad_scale * weight * logit_scale * dloss/dx_j, the gradient of u_j = h . w_j. Zeros for an
// ignored token.
void ComputeShardRowGradientWithTerms(float* z, int64_t rows, int64_t local_target, bool ignored,
                                      const ShardTokenLoss& token, const LossOptions& options,
                                      int64_t v, double entropy, const TokenTerms& inputs,
                                      float grad_scale);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_SHARD_ROWS_H_
