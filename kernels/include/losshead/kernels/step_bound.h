// Bounds of what one micro-batch computes, from bounds of its inputs. A micro-batch whose loss,
// dH or part of dW could overflow is refused before anything runs: one hidden row of 3e38 (a
// valid bf16 value) would otherwise turn every element of the shared dW window NaN, other
// micro-batches' contributions included.
//
// With |h| <= H and |w| <= W elementwise, D columns and V rows (LossOptions' notation):
//   raw logits       |x| <= D H W                  (each an fp32 sum of D products)
//   capped logits    |z| <= min(D H W, softcap) =: Z
//   lse              |lse| <= Z + ln V =: L
//   a token's loss   <= 2 Z + ln V + z_loss L^2    (label smoothing eps in [0, 1])
//   its gradient     sum_j |g_j| <= 2 + 2 z_loss L (p sums to 1; the soft-cap's derivative <= 1)
// and with s = |grad_scale| (divided by the counted tokens for kMean): |dH| <= s (2 + 2 z_loss L) W,
// and each dW element gains at most counted * s (2 + 2 z_loss L) H. The bounds are exact in the
// worst case up to the D H W of the logits, which is loose by up to D for real data: a refusal
// needs inputs some 30 orders of magnitude past any trained model's.
#ifndef LOSSHEAD_KERNELS_STEP_BOUND_H_
#define LOSSHEAD_KERNELS_STEP_BOUND_H_

#include <cstdint>

#include "absl/status/status.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

struct StepBounds {
  double logit = 0;        // |x|, before the soft-cap
  double loss_sum = 0;     // |sum of the counted tokens' losses|
  double grad = 0;         // |g_j| unscaled, as the kernels round it to the head's dtype
  double scaled_grad = 0;  // |g_j| times the reduction's scale (a gradient stash keeps it so)
  double grad_hidden = 0;  // |dH|
  double grad_weight = 0;  // what the micro-batch adds to any element of dW
};

// The bounds of `problem` (valid) with |h| <= hidden_abs, |w| <= weight_abs and `counted_tokens`
// targets that are not ignore_index. +Inf in, +Inf out.
StepBounds BoundStep(const Problem& problem, double hidden_abs, double weight_abs,
                     int64_t counted_tokens);

// What an embedding-gradient micro-batch of a tied head (Backend::IndexAddRows) adds to any
// element of dW: each row's elements are bounded by `row_abs`, and one id carries at most
// `max_repeats` rows, whose sum lands on its row of dW. The window's guard adds it to the
// window's bound like a loss micro-batch's grad_weight. +Inf in, +Inf out.
double BoundEmbeddingGrad(double row_abs, int64_t max_repeats);

// The largest finite magnitude of `dtype`.
double DTypeMax(DType dtype);

// True when `value` stays finite in `dtype` with room for the roundings of the sums that make it
// (a factor of 2: fp32 sums of up to a million terms err by less than 7 %).
bool WithinRange(double value, DType dtype);

// OUT_OF_RANGE naming the first result that could overflow: the logits or the loss (fp32), the
// logit gradient (the head's dtype unscaled, fp32 scaled), dH (the head's dtype and
// `grad_hidden_dtype`) or, when `grad_weight`, the micro-batch's part of dW (fp32). The message
// gives the inputs' bounds and says that nothing was computed. OK when every one stays finite.
absl::Status CheckStepBounds(const Problem& problem, const StepBounds& bounds,
                             double hidden_abs, double weight_abs, DType grad_hidden_dtype,
                             bool grad_weight);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_STEP_BOUND_H_
