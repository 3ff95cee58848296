// Test helpers for Backend::CheckOptimizerStep and kernels::StepMagnitudeBound: start buffers
// of chosen magnitudes, and a check followed by the step it judges, on the same buffers of any
// backend, with every buffer brought back after each.
#ifndef LOSSHEAD_TESTS_KERNELS_OPTIMIZER_CHECK_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_OPTIMIZER_CHECK_RUNNER_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/optimizer.h"
#include "tests/kernels/optimizer_runner.h"

namespace losshead::kernels::testing {

// One step's inputs on the host: the fp32 parameters (the master; for fp32 weights the weights
// themselves, and for 16-bit weights the weights start as their rounding), the raw gradient and
// the state.
struct StepStart {
  std::vector<float> param;
  std::vector<float> grad;
  std::vector<float> state_a;
  std::vector<float> state_b;
};

// `count` elements for a step of `problem` whose magnitudes reach `reach` and `grad_abs`: element
// 0 holds the largest parameter, state and gradient with random signs, element 1 the largest
// parameter, exp_avg and gradient with an empty exp_avg_sq (AdamW's largest move), the rest random
// below them (log-uniform over ten decades, zeros among them). State the problem's rule does not
// use stays zero, as the check reads it.
StepStart StartWithin(const OptimizerProblem& problem, const OptimizerMagnitudes& reach,
                      double grad_abs, std::mt19937_64& rng);

// A step of case `c` (its optimizer, dtype and shape; step 3) from random buffers: `overflow`
// false, weights near 1 and no exp_avg yet, so nothing overflows (a first moment over an empty
// second one would move an AdamW weight by m / eps, past fp16); true, weights near the dtype's
// limit and an lr of the limit's size, so that many elements overflow.
struct CheckScenario {
  OptimizerProblem problem;
  StepStart start;
};
CheckScenario MakeCheckScenario(const OptimizerCase& c, bool overflow, std::mt19937_64& rng);

// What one CheckOptimizerStep and then OptimizerStep did to the same buffers.
struct CheckedStep {
  OptimizerCheck check;
  OptimizerOutputs before;       // every buffer as uploaded
  OptimizerOutputs after_check;  // every buffer right after the check
  OptimizerOutputs after_step;   // and after the step that followed
};

// Uploads `start` (the weights as the parameters rounded to the dtype), checks, then steps,
// `offset` elements into every allocation (1 misaligns them for vector loads).
absl::StatusOr<CheckedStep> CheckThenStep(Backend& backend, const OptimizerProblem& problem,
                                          const StepStart& start, int64_t offset = 0);

// What the check must find, read off the step's own outputs: the elements where the new
// parameter, its rounding to `dtype` or a state value is not finite, and the largest new
// magnitudes (NaN left out).
OptimizerCheck CheckFromStep(DType dtype, const OptimizerOutputs& after_step);

// True when two outputs hold the same bits in every buffer.
bool SameBits(const OptimizerOutputs& a, const OptimizerOutputs& b);

// A description of the check's result for failure messages.
std::string Describe(const OptimizerCheck& check);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_OPTIMIZER_CHECK_RUNNER_H_
