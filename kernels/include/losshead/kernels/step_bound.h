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
//
// The terms of LossOptions widen them (S = logit_scale, c = |entropy_coef|, k = kl_coef; over the
// counted tokens, Wt = max |w_t| (1 without token weights), A = max |A_t|, R = exp(max(0,
// max_t -o_t)) for the old log-probs o_t):
//   raw logits       |x| <= S D H W
//   entropy          |H_t| <= 2 Z + ln V  (as computed, lse - sum_j p_j z_j)
//   cross-entropy    loss <= Wt (2 Z + ln V + z_loss L^2 + c (2 Z + ln V))
//   policy gradient  r_t = exp(log p_t - o_t) <= R (log p_t <= 0), so the clipped term is at most
//                    A max(R, 1 + clip_high); the KL term, k3 clamped at kKlClamp = 10
//                    (loss_math.h), is at most k 10; loss <= Wt (those + z_loss L^2 + c (2 Z +
//                    ln V))
//   gradient         sum_j |g_j| <= Wt max(1, S) (2 |dloss/dlog p| + 2 z_loss L + 2 c Z), with
//                    dloss/dlog p = 1 (cross-entropy) or A R + k KlSlopeBound() (policy gradient)
// Both are as tight as the inputs make them: the KL term's bounds hold whatever log p_t and the
// reference's q_t are, so they do not depend on Z.
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

// Bounds of the per-token inputs of LossOptions' terms over the counted tokens (see above).
struct TermInputBounds {
  double weight_abs = 1.0;      // max |w_t|; 1 without token weights
  double advantage_abs = 0.0;   // max |A_t|
  double old_logprob_neg = 0.0;  // max(0, max_t -o_t)
};

// The bounds of `problem` (valid) with |h| <= hidden_abs, |w| <= weight_abs and `counted_tokens`
// targets that are not ignore_index, its terms' inputs bounded by `terms`. +Inf in, +Inf out.
StepBounds BoundStep(const Problem& problem, double hidden_abs, double weight_abs,
                     int64_t counted_tokens, const TermInputBounds& terms = {});

// The largest |dk3/dlog p| where the clamped k3 passes its gradient: max(1, exp(d*) - 1) with d*
// the positive root of exp(d) - d - 1 = kKlClamp (loss_math.h), about 12.6.
double KlSlopeBound();

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
