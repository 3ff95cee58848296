// The per-token half of the fused op: loss, lse and logit gradient of one row of logits.
#ifndef LOSSHEAD_KERNELS_CPU_ROW_LOSS_H_
#define LOSSHEAD_KERNELS_CPU_ROW_LOSS_H_

#include <cstdint>

#include "losshead/kernels/problem.h"

namespace losshead::kernels {

struct RowLoss {
  double loss = 0.0;  // unscaled per-token loss; 0 for an ignored token
  double lse = 0.0;   // log-sum-exp of the (soft-capped) logits
};

// One token's distribution outputs (Arguments, problem.h), of p = softmax(z).
struct RowDistribution {
  double logprob = 0.0;  // log p_target
  double entropy = 0.0;
  int32_t argmax = -1;  // lowest index of the max z
  // Top-k (Arguments::top_k_ids, top_k_logprobs): where to write the token's top_k ids and
  // log-probs (either may be null; top_k 0: none), filled by ComputeRowLoss.
  int top_k = 0;
  int32_t* top_k_ids = nullptr;
  float* top_k_logprobs = nullptr;
};

// Writes the token's top `distribution.top_k` ids and log-probs (none when top_k is 0) from its
// `v` logits z (after scale, bias and soft-cap) and their log-sum-exp `lse`.
void WriteRowTopK(const float* z, int64_t v, double lse, const RowDistribution& distribution);

// Computes the loss of one token from its `v` fp32 logits x_j = h . w_j, exactly as LossOptions
// defines it, and (when `write_gradient`) overwrites `logits` with grad_scale * dloss/dx_j: the
// soft-capped gradient, already multiplied by `grad_scale` (the reduction's effective scale).
// An ignored token (`ignored`) still gets its lse; its gradient row is all zeros. `target` must be
// in [0, v) unless `ignored`. Reductions over the row are done in double; the max is subtracted
// before exponentiating, so logits of any finite size are safe.
// When `distribution` is not null and the token is not ignored, it receives the token's
// distribution outputs; the loss, lse and gradient are the same bits either way. An ignored
// token's `distribution` is left as it is.
RowLoss ComputeRowLoss(float* logits, int64_t v, int32_t target, bool ignored,
                       const LossOptions& options, float grad_scale, bool write_gradient,
                       RowDistribution* distribution = nullptr);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_ROW_LOSS_H_
