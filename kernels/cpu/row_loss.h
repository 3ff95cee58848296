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

// Computes the loss of one token from its `v` fp32 logits x_j = h . w_j, exactly as LossOptions
// defines it, and (when `write_gradient`) overwrites `logits` with grad_scale * dloss/dx_j: the
// soft-capped gradient, already multiplied by `grad_scale` (the reduction's effective scale).
// An ignored token (`ignored`) still gets its lse; its gradient row is all zeros. `target` must be
// in [0, v) unless `ignored`. Reductions over the row are done in double; the max is subtracted
// before exponentiating, so logits of any finite size are safe.
RowLoss ComputeRowLoss(float* logits, int64_t v, int32_t target, bool ignored,
                       const LossOptions& options, float grad_scale, bool write_gradient);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_ROW_LOSS_H_
