// The per-token half of the fused op when a model option or loss term beyond the plain loss is on
// (logit scale, bias, per-token weights, the entropy term, the policy-gradient loss: problem.h).
// A call that turns none on runs ComputeRowLoss (row_loss.h) alone, so its results are the bits
// they always were.
#ifndef LOSSHEAD_KERNELS_CPU_ROW_TERMS_H_
#define LOSSHEAD_KERNELS_CPU_ROW_TERMS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/loss_math.h"
#include "kernels/cpu/row_loss.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// Whether a call needs ComputeRowLossWithTerms: a term of `options` is on, or `args` gives a bias
// or per-token weights (the policy-gradient inputs come with its kind; grad_bias with a bias).
bool RowTermsOn(const LossOptions& options, const Arguments& args);

// Checks that every value the terms will read is finite (INVALID_ARGUMENT naming the field and
// its index): each bias entry, and the per-token inputs of tokens whose target is not
// ignore_index (targets already checked). Reads host memory only; writes nothing.
absl::Status CheckTermInputs(const Problem& problem, const Arguments& args);

// One token's inputs to the terms (1 and 0 where the call gives none), in double.
using TokenTerms = loss::BasicTokenInputs<double>;

// The token's inputs from `args`, for token t.
TokenTerms TokenTermsOf(const Arguments& args, int64_t t);

// ComputeRowLoss with the terms: `logits` holds u_j = h . w_j, becomes x_j = logit_scale u_j +
// bias_j before the soft-cap, and (when `write_gradient`) ends as
//   grad_scale * weight * logit_scale * dloss/dx_j,
// the gradient of u_j (dloss/db_j is it divided by logit_scale). RowLoss::loss is the weighted
// loss. `bias` is V fp32 or null.
RowLoss ComputeRowLossWithTerms(float* logits, int64_t v, int32_t target, bool ignored,
                                const LossOptions& options, const float* bias,
                                const TokenTerms& token, float grad_scale, bool write_gradient,
                                RowDistribution* distribution = nullptr);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_ROW_TERMS_H_
