// Float64 optimizers written straight from the formulas of torch.optim.AdamW, torch.optim.SGD and
// Lion: the independent oracle for the backends' optimizer steps.
#ifndef LOSSHEAD_TESTS_KERNELS_REFERENCE_OPTIMIZER_H_
#define LOSSHEAD_TESTS_KERNELS_REFERENCE_OPTIMIZER_H_

#include <cstdint>
#include <vector>

#include "losshead/kernels/optimizer.h"

namespace losshead::kernels::testing {

// Parameters and state, all in float64. `a` is exp_avg (AdamW, Lion) or the momentum buffer
// (SGD), `b` is exp_avg_sq (AdamW).
struct ReferenceOptimizerState {
  std::vector<double> param;
  std::vector<double> a;
  std::vector<double> b;
  bool momentum_buffer_set = false;  // SGD: torch's "momentum_buffer is not None"
};

// One step with the raw gradient `grad` scaled by `grad_scale`; `step` is 1-based. The state
// vectors start at zero (a and b are sized on the first call).
void ReferenceOptimizerStep(const OptimizerOptions& options, double grad_scale, int64_t step,
                            const std::vector<float>& grad, ReferenceOptimizerState* state);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_REFERENCE_OPTIMIZER_H_
