// A naive float64 fused linear + cross-entropy, written straight from the formulas in problem.h.
// It is the independent oracle for the backends' tests: O(N V D), for small shapes only.
#ifndef LOSSHEAD_TESTS_KERNELS_REFERENCE_LOSS_H_
#define LOSSHEAD_TESTS_KERNELS_REFERENCE_LOSS_H_

#include <cstdint>
#include <vector>

#include "losshead/kernels/problem.h"

namespace losshead::kernels::testing {

// Everything one call produces, in float64. `grad_weight` is this call's contribution only (what a
// backend adds to its accumulator), `grad_hidden` is before rounding to the problem's dtype.
struct ReferenceResult {
  double loss_sum = 0.0;
  int64_t token_count = 0;
  std::vector<double> per_token_loss;  // N, 0 for ignored tokens
  std::vector<double> per_token_lse;   // N
  // Of p = softmax(z), as Arguments defines them (problem.h): 0, 0 and -1 for ignored tokens.
  std::vector<double> per_token_logprob;  // N, log p_y
  std::vector<double> per_token_entropy;  // N, -sum_j p_j log p_j
  std::vector<int32_t> per_token_argmax;  // N, lowest j of the max z
  std::vector<double> per_token_top_gap;  // N, max z - the next largest distinct z (Inf if none)
  int64_t correct_count = 0;              // non-ignored tokens with argmax == target
  std::vector<double> grad_hidden;        // N x D
  std::vector<double> grad_weight;        // V x D
};

// `hidden` (N x D) and `weight` (V x D) are the values the backend sees, i.e. already rounded to
// problem.dtype. Targets must be valid (in [0, V) or ignore_index).
ReferenceResult ReferenceLoss(const Problem& problem, const std::vector<double>& hidden,
                              const std::vector<double>& weight,
                              const std::vector<int32_t>& targets);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_REFERENCE_LOSS_H_
