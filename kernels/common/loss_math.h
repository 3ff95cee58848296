// The loss of one token and its derivative with respect to the logits, as LossOptions defines them
// (problem.h), written once for every device: the CPU backend (row_loss.cc, shard_rows.cc) and the
// CUDA row kernels (softmax_grad.cu, shard_softmax.cu) evaluate these functions and nothing else
// of the formula. A new loss option is a new term here (docs/adding-a-loss-option.md).
//
// Per token with target y, logits x_j, eps = label_smoothing:
//   z_j    = Softcap::Apply(x_j)                        = cap tanh(x_j / cap)  (x_j when cap = 0)
//   lse    = Lse(max_j z_j, sum_j exp(z_j - max))
//   loss   = TargetTerm + SmoothingTerm + ZLossTerm     = (1 - eps)(lse - z_y)
//                                                         + eps (lse - sum_j z_j / V)
//                                                         + z_loss lse^2
//   dloss/dz_j = exp(z_j - lse) ZLossFactor - UniformShare - TargetShare [j == y]
//              = p_j (1 + 2 z_loss lse)  - eps / V      - (1 - eps) [j == y]
//   dloss/dx_j = dloss/dz_j SoftcapSlope(z_j / cap)     = dloss/dz_j (1 - (z_j / cap)^2)
//
// and what the model predicts, of p = softmax(z) (Arguments' distribution outputs, problem.h):
//   log p_y  = TargetLogProb(lse, z_y)                   = z_y - lse
//   entropy  = Entropy(sum_exp, sum_j ShiftedZTerm(..))  = lse - sum_j p_j z_j
//   argmax   = the lowest j with z_j = max: ArgmaxBeats orders the candidates
//
// Invariants the callers rely on:
// - Each function is one expression tree, so a caller that inlines it computes the bits it
//   computed when the expression was written out at the call site: rounding and (on the device)
//   the compiler's contraction into FMAs see the same operations in the same order.
// - The real type T is the caller's: the CPU backend evaluates the row terms in double, the row
//   kernel in fp32, the shard combination in double on both devices.
// - Exp is the device's fast __expf in fp32 device code and the C library's exp elsewhere: CPU and
//   CUDA agree to the exp's few ulps, not bit for bit (tests compare them with a tolerance).
#ifndef LOSSHEAD_KERNELS_COMMON_LOSS_MATH_H_
#define LOSSHEAD_KERNELS_COMMON_LOSS_MATH_H_

#include <cmath>

#include "losshead/kernels/problem.h"

#ifndef LOSSHEAD_HD
#if defined(__CUDACC__)
#define LOSSHEAD_HD __host__ __device__ __forceinline__
#else
#define LOSSHEAD_HD inline
#endif
#endif

namespace losshead::kernels::loss {

// The loss options the formula reads: LossOptions (problem.h) less what is not per token
// (ignore_index, reduction, grad_scale). Every kernel receives them as this one struct (the row
// kernels inside their launch parameters) and hands it to the functions below without reading
// the fields that are terms of the loss: a new loss option is a field here, its term below and
// its line in OptionsOf, and no kernel changes (docs/adding-a-loss-option.md).
struct Options {
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;  // 0 = off; applied to every logit, so the kernels build a Softcap of it
};

inline Options OptionsOf(const LossOptions& o) {
  return Options{o.label_smoothing, o.z_loss, o.softcap};
}

// exp, log and tanh of the device the caller runs on (see the file comment).
LOSSHEAD_HD float Exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

LOSSHEAD_HD double Exp(double x) {
#ifdef __CUDA_ARCH__
  return exp(x);
#else
  return std::exp(x);
#endif
}

LOSSHEAD_HD float Log(float x) {
#ifdef __CUDA_ARCH__
  return logf(x);
#else
  return std::log(x);
#endif
}

LOSSHEAD_HD double Log(double x) {
#ifdef __CUDA_ARCH__
  return log(x);
#else
  return std::log(x);
#endif
}

LOSSHEAD_HD float Tanh(float x) {
#ifdef __CUDA_ARCH__
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

LOSSHEAD_HD double Tanh(double x) {
#ifdef __CUDA_ARCH__
  return tanh(x);
#else
  return std::tanh(x);
#endif
}

// The logit soft-cap z = cap tanh(x / cap); cap = 0 is off. ValidSoftcap (problem.h) keeps cap
// normal, so inv_cap is finite; Apply forms x / cap as x * inv_cap. The kernels use Softcap
// (fp32); BasicSoftcap<double> is the same formula in double, for tests.
template <typename T>
struct BasicSoftcap {
  T cap = T(0);
  T inv_cap = T(0);

  LOSSHEAD_HD static BasicSoftcap Of(T cap) {
    return BasicSoftcap{cap, cap > T(0) ? T(1) / cap : T(0)};
  }
  LOSSHEAD_HD bool on() const { return cap > T(0); }
  // z of x; only when on().
  LOSSHEAD_HD T Apply(T x) const { return cap * Tanh(x * inv_cap); }
  // z of x, x itself when off. (Spelled out rather than through on(): the extra call changes
  // how nvcc unswitches the row kernels' loops, and with it their registers.)
  LOSSHEAD_HD T operator()(T x) const { return cap > T(0) ? Apply(x) : x; }
};
using Softcap = BasicSoftcap<float>;

// dz/dx of the soft-cap at z, from ratio = z / cap: 1 - ratio^2 (<= 1, so the soft-cap never
// grows a gradient).
template <typename T>
LOSSHEAD_HD T SoftcapSlope(T ratio) {
  return T(1) - ratio * ratio;
}

// The online softmax's rescaling: a partial sum of exp(z - m) expressed against a larger max.
template <typename T>
LOSSHEAD_HD T Rescaled(T sum_exp, T m, T max) {
  return sum_exp * Exp(m - max);
}

// log sum_j exp(z_j) from the row's max and sum_j exp(z_j - max).
template <typename T>
LOSSHEAD_HD T Lse(T max, T sum_exp) {
  return max + Log(sum_exp);
}

// The loss's three terms (file comment). v is the whole vocabulary's size, sum_z the sum of z
// over all of it.
template <typename T>
LOSSHEAD_HD T TargetTerm(T eps, T lse, T z_target) {
  return (T(1) - eps) * (lse - z_target);
}

template <typename T>
LOSSHEAD_HD T SmoothingTerm(T eps, T lse, T sum_z, T v) {
  return eps * (lse - sum_z / v);
}

template <typename T>
LOSSHEAD_HD T ZLossTerm(T z_loss, T lse) {
  return z_loss * lse * lse;
}

// A counted token's loss from its lse, z of its target and the sum of z over the whole
// vocabulary of v classes, its terms added in file-comment order: the CPU backend and the shard
// combination (both in double).
template <typename T>
LOSSHEAD_HD T TokenLoss(const Options& o, T lse, T z_target, T sum_z, T v) {
  const T eps = o.label_smoothing;
  return TargetTerm(eps, lse, z_target) + SmoothingTerm(eps, lse, sum_z, v) +
         ZLossTerm(static_cast<T>(o.z_loss), lse);
}

// The row kernel's fp32 evaluation of the same loss: the smoothing term added last and only when
// eps > 0, so that without label smoothing a huge sum_z (Inf) cannot turn the loss into NaN.
LOSSHEAD_HD float TokenLossSmoothingLast(const Options& o, float lse, float z_target, float sum_z,
                                         float v) {
  const float eps = o.label_smoothing;
  float loss = TargetTerm(eps, lse, z_target) + ZLossTerm(o.z_loss, lse);
  if (eps > 0.0f) loss += SmoothingTerm(eps, lse, sum_z, v);
  return loss;
}

// The per-token factors of the gradient (file comment): p_j's factor from the z-loss, the label
// smoothing's share of every class, the target's share.
template <typename T>
LOSSHEAD_HD T ZLossFactor(T z_loss, T lse) {
  return T(1) + T(2) * z_loss * lse;
}

template <typename T>
LOSSHEAD_HD T UniformShare(T eps, T v) {
  return eps / v;
}

template <typename T>
LOSSHEAD_HD T TargetShare(T eps) {
  return T(1) - eps;
}

// A token's gradient factors, each already multiplied by whatever scale the caller folds in (the
// CPU backend folds grad_scale and 1 / sum_exp into p_scale; the row kernels fold nothing and
// multiply afterwards). The kernels use GradFactors (fp32).
template <typename T>
struct BasicGradFactors {
  T p_scale = T(1);  // multiplies exp(z_j - shift)
  T uniform = T(0);  // subtracted from every class
  T target = T(0);   // subtracted from the target's class
};
using GradFactors = BasicGradFactors<float>;

// A token's gradient factors in T from its lse (v: the whole vocabulary's size), unscaled.
template <typename T>
LOSSHEAD_HD BasicGradFactors<T> GradFactorsOf(const Options& o, T lse, T v) {
  const T eps = o.label_smoothing;
  return BasicGradFactors<T>{ZLossFactor(static_cast<T>(o.z_loss), lse), UniformShare(eps, v),
                             TargetShare(eps)};
}

// The CPU backend's and the shard combination's fp32 factors: unscaled double factors f with
// 1 / p_divisor folded into p_scale and `scale` into all three, each rounded once (p_divisor = 1
// divides exactly).
LOSSHEAD_HD GradFactors FoldedGradFactors(const BasicGradFactors<double>& f, double p_divisor,
                                          double scale) {
  return GradFactors{static_cast<float>(f.p_scale / p_divisor * scale),
                     static_cast<float>(f.uniform * scale), static_cast<float>(f.target * scale)};
}

// dloss/dz_j from e = exp(z_j - shift): e p_scale - uniform - target [is_target]. For a class that
// is not the target the last subtraction is of +0, which changes no value.
template <typename T>
LOSSHEAD_HD T LogitGrad(const BasicGradFactors<T>& f, T e, bool is_target) {
  return e * f.p_scale - f.uniform - (is_target ? f.target : T(0));
}

// Log-probability of the target under p = softmax(z): z_y - lse (<= 0 up to rounding). Without
// label smoothing and z-loss it is TargetTerm's negation, bit for bit.
template <typename T>
LOSSHEAD_HD T TargetLogProb(T lse, T z_target) {
  return z_target - lse;
}

// The entropy -sum_j p_j log p_j = lse - sum_j p_j z_j, written against the row's max so that
// the max, which cancels, costs no digits: with e_j = exp(z_j - max), sum_exp = sum_j e_j and
// s = sum_j ShiftedZTerm(e_j, z_j - max) (<= 0), the entropy is log(sum_exp) - s / sum_exp, a
// difference of two terms >= 0. A shard's s moves to a larger max with RescaledShiftedZ.
template <typename T>
LOSSHEAD_HD T ShiftedZTerm(T e, T shifted_z) {
  return e * shifted_z;
}

template <typename T>
LOSSHEAD_HD T Entropy(T sum_exp, T sum_shifted_z) {
  return Log(sum_exp) - sum_shifted_z / sum_exp;
}

// A partial s (with its sum_exp) taken against max m, expressed against a larger max:
// sum_j e^(z_j - max) (z_j - max) = e^(m - max) (s + (m - max) sum_exp).
template <typename T>
LOSSHEAD_HD T RescaledShiftedZ(T sum_shifted_z, T sum_exp, T m, T max) {
  return Exp(m - max) * (sum_shifted_z + (m - max) * sum_exp);
}

// The argmax's order: a candidate (z, id) replaces the best so far (best_z, best_id) when its z is
// larger, or equal with a lower id. Whatever order candidates are visited in (a row in index
// order, threads, shards), the winner is the lowest id among the maxima. A NaN never wins and is
// never beaten: a caller that starts from the row's first element keeps an id in the row.
template <typename T, typename Id>
LOSSHEAD_HD bool ArgmaxBeats(T z, Id id, T best_z, Id best_id) {
  return z > best_z || (z == best_z && id < best_id);
}

// ---------------------------------------------------------------------------------------------
// The model options and further terms of LossOptions (problem.h): logit scale and bias, the
// entropy term, the policy-gradient loss. Per token, with c = the token's weight times the
// reduction's scale (the caller's), log p = TargetLogProb(lse, z_y), H = Entropy(..):
//   x_j        = ScaledLogit(h . w_j, logit_scale, b_j)           = logit_scale (h . w_j) + b_j
//   loss       = cross-entropy: TokenLoss(..)                           + EntropyTerm(coef, H)
//                policy gradient: PolicyTokenLoss(..) (+ its z-loss)   + EntropyTerm(coef, H)
//   dloss/dz_j = LogitGrad(factors, e_j, j == y) + EntropyLogitGrad(entropy, e_j, z_j - max)
// with the factors GradFactorsOf (cross-entropy) or PolicyGradFactorsOf (policy gradient, of
// dloss/dlog p = PolicyLogProbSlope), chained through the soft-cap as above, and through the
// scale by logit_scale (dloss/d(h . w_j) = logit_scale dloss/dx_j, dloss/db_j = dloss/dx_j).

// What the terms read of LossOptions. A struct of its own rather than fields of Options: the
// kernels that do not compute these terms yet receive the launch parameters they always did.
struct TermOptions {
  float logit_scale = 1.0f;  // 1 = off
  float entropy_coef = 0.0f;
  bool policy_gradient = false;
  float clip_low = 0.2f;
  float clip_high = 0.2f;
  float kl_coef = 0.0f;
};

inline TermOptions TermOptionsOf(const LossOptions& o) {
  return TermOptions{o.logit_scale, o.entropy_coef, o.kind == LossKind::kPolicyGradient,
                     o.clip_low,    o.clip_high,    o.kl_coef};
}

// Whether any of them is on: a row without them runs the plain row, unchanged.
inline bool AnyTerm(const TermOptions& t) {
  return t.logit_scale != 1.0f || t.entropy_coef != 0.0f || t.policy_gradient;
}

// The logit from u = h . w_j.
template <typename T>
LOSSHEAD_HD T ScaledLogit(T u, T scale, T bias) {
  return scale * u + bias;
}

template <typename T>
LOSSHEAD_HD T EntropyTerm(T coef, T entropy) {
  return coef * entropy;
}

// The entropy term's gradient, dH/dz_j = -p_j (z_j - sum_k p_k z_k), written against the row's
// max as Entropy is: with e_j = exp(z_j - max), sum_exp and s = sum_j ShiftedZTerm(e_j, z_j - max),
// p_j = e_j / sum_exp and z_j - sum_k p_k z_k = (z_j - max) - s / sum_exp. `scale` multiplies e_j
// (the coefficient, -1 / sum_exp and the caller's scale folded in), `mean_shifted_z` = s / sum_exp.
template <typename T>
struct BasicEntropyGrad {
  T scale = T(0);
  T mean_shifted_z = T(0);
};
using EntropyGrad = BasicEntropyGrad<float>;

// The CPU backend's fp32 factors from double statistics, each rounded once.
inline EntropyGrad FoldedEntropyGrad(double coef, double sum_exp, double sum_shifted_z,
                                     double scale) {
  return EntropyGrad{static_cast<float>(-coef / sum_exp * scale),
                     static_cast<float>(sum_shifted_z / sum_exp)};
}

template <typename T>
LOSSHEAD_HD T EntropyLogitGrad(const BasicEntropyGrad<T>& f, T e, T shifted_z) {
  return e * f.scale * (shifted_z - f.mean_shifted_z);
}

// The policy ratio r = p / p_old from log p and the old log p.
template <typename T>
LOSSHEAD_HD T PolicyRatio(T logprob, T old_logprob) {
  return Exp(logprob - old_logprob);
}

// torch.clamp(r, lo, hi) for lo <= hi.
template <typename T>
LOSSHEAD_HD T ClipRatio(T r, T lo, T hi) {
  return r < lo ? lo : (r > hi ? hi : r);
}

// -min(r A, clip(r, lo, hi) A).
template <typename T>
LOSSHEAD_HD T ClippedPolicyTerm(T r, T advantage, T lo, T hi) {
  const T unclipped = r * advantage;
  const T clipped = ClipRatio(r, lo, hi) * advantage;
  return -(unclipped < clipped ? unclipped : clipped);
}

// Its derivative in r as PyTorch's autograd takes it: torch.min (minimum) sends the gradient to
// the smaller operand, half to each at a tie; torch.clamp passes it where lo <= r <= hi (bounds
// included) and stops it elsewhere. So -A where r A < clip(r) A, -A [lo <= r <= hi] where
// r A > clip(r) A, and -A (1 + [lo <= r <= hi]) / 2 at a tie.
template <typename T>
LOSSHEAD_HD T ClippedPolicySlope(T r, T advantage, T lo, T hi) {
  const T unclipped = r * advantage;
  const T clipped = ClipRatio(r, lo, hi) * advantage;
  const T passes = (r >= lo && r <= hi) ? T(1) : T(0);
  const T share = unclipped < clipped   ? T(1)
                  : unclipped > clipped ? passes
                                        : (T(1) + passes) / T(2);
  return -advantage * share;
}

// The KL term: verl's low-variance KL, the k3 estimator k3 = exp(q - log p) - (q - log p) - 1
// (>= 0) against the reference's log p q, clamped at kKlClamp and times its coefficient:
// kl_coef min(k3, kKlClamp), as torch.clamp(k3, max=kKlClamp). The clamp keeps one token whose
// policy has drifted far from the reference from dominating the loss, and bounds the term
// whatever log p is (step_bound.h relies on it). Its derivative in log p is autograd's through
// the clamp: kl_coef (1 - exp(q - log p)) where k3 <= kKlClamp (the bound included, as
// torch.clamp and ClippedPolicySlope pass the gradient at their bounds), 0 above it.
inline constexpr double kKlClamp = 10.0;

// The root d* > 0 of exp(d) - d - 1 = kKlClamp: where k3 is not clamped, q - log p lies in
// [d_-, d*] (d_- < 0 the other root), so |dk3/dlog p| = |1 - exp(q - log p)| is at most
// max(1 - exp(d_-), exp(d*) - 1) = exp(d*) - 1 (about 12.611). Newton's iteration from d = 3 (above
// the root, where the function is convex and increasing) converges from above in a few steps;
// tests check the residual.
inline double KlClampRoot() {
  double d = 3.0;
  for (int i = 0; i < 64; ++i) {
    const double next = d - (std::exp(d) - d - 1.0 - kKlClamp) / (std::exp(d) - 1.0);
    if (!(next < d)) break;
    d = next;
  }
  return d;
}

// k3 itself, unclamped, from d = q - log p.
template <typename T>
LOSSHEAD_HD T KlK3(T d) {
  return (Exp(d) - T(1)) - d;
}

template <typename T>
LOSSHEAD_HD T KlTerm(T kl_coef, T ref_logprob, T logprob) {
  const T k3 = KlK3(ref_logprob - logprob);
  return kl_coef * (k3 > static_cast<T>(kKlClamp) ? static_cast<T>(kKlClamp) : k3);
}

template <typename T>
LOSSHEAD_HD T KlSlope(T kl_coef, T ref_logprob, T logprob) {
  const T d = ref_logprob - logprob;
  return KlK3(d) <= static_cast<T>(kKlClamp) ? kl_coef * (T(1) - Exp(d)) : T(0);
}

// A counted token's policy-gradient loss, its terms in problem.h's order: the clipped term, the
// KL term (when kl_coef > 0), the z-loss. r = PolicyRatio(logprob, old_logprob).
template <typename T>
LOSSHEAD_HD T PolicyTokenLoss(const Options& o, const TermOptions& t, T lse, T logprob, T r,
                              T advantage, T ref_logprob) {
  T loss = ClippedPolicyTerm(r, advantage, T(1) - static_cast<T>(t.clip_low),
                             T(1) + static_cast<T>(t.clip_high));
  if (t.kl_coef > 0.0f) loss += KlTerm(static_cast<T>(t.kl_coef), ref_logprob, logprob);
  return loss + ZLossTerm(static_cast<T>(o.z_loss), lse);
}

// dloss/dlog p of the policy-gradient loss (less the z-loss, which depends on lse only):
// dloss/dr r + the KL term's slope.
template <typename T>
LOSSHEAD_HD T PolicyLogProbSlope(const TermOptions& t, T logprob, T r, T advantage, T ref_logprob) {
  T slope = ClippedPolicySlope(r, advantage, T(1) - static_cast<T>(t.clip_low),
                               T(1) + static_cast<T>(t.clip_high)) *
            r;
  if (t.kl_coef > 0.0f) slope += KlSlope(static_cast<T>(t.kl_coef), ref_logprob, logprob);
  return slope;
}

// The policy-gradient loss's factors, unscaled, from c = dloss/dlog p: as dlog p/dz_j is
// [j == y] - p_j and the z-loss adds 2 z_loss lse p_j, p_scale = 2 z_loss lse - c, no uniform
// share, and the target's share -c (LogitGrad subtracts it).
template <typename T>
LOSSHEAD_HD BasicGradFactors<T> PolicyGradFactorsOf(const Options& o, T lse, T dlogprob) {
  return BasicGradFactors<T>{T(2) * static_cast<T>(o.z_loss) * lse - dlogprob, T(0), -dlogprob};
}

// One counted token's inputs to the terms, as a call gives them per token (problem.h's
// Arguments): 1 and 0 where it gives none.
template <typename T>
struct BasicTokenInputs {
  T weight = T(1);
  T old_logprob = T(0);
  T advantage = T(0);
  T ref_logprob = T(0);
};

// A counted token's loss with the terms, unweighted, and its gradient factors for
// e_j = exp(z_j - lse), unscaled (the caller folds in the weight, the logit scale and its own
// scale).
template <typename T>
struct BasicTermsLoss {
  T loss = T(0);
  BasicGradFactors<T> factors;
};

// The terms' part of a token, written once for every row that computes them (the CPU row and
// shard rows in double, the CUDA row kernel in fp32, the CUDA shard combination in double): from
// the token's lse, z of its target, the whole vocabulary's size v and its entropy (read only with
// entropy_coef != 0), the policy-gradient loss (PolicyTokenLoss, PolicyGradFactorsOf) or the
// cross-entropy (`cross_entropy()`: the caller's evaluation of the plain loss, TokenLoss or
// TokenLossSmoothingLast, called only for that kind; GradFactorsOf), plus the entropy term.
template <typename T, typename CrossEntropy>
LOSSHEAD_HD BasicTermsLoss<T> TermsLossOf(const Options& o, const TermOptions& t, T lse, T z_target,
                                          T v, T entropy, const BasicTokenInputs<T>& in,
                                          CrossEntropy cross_entropy) {
  BasicTermsLoss<T> r;
  if (t.policy_gradient) {
    const T logprob = TargetLogProb(lse, z_target);
    const T ratio = PolicyRatio(logprob, in.old_logprob);
    r.loss = PolicyTokenLoss(o, t, lse, logprob, ratio, in.advantage, in.ref_logprob);
    r.factors = PolicyGradFactorsOf(
        o, lse, PolicyLogProbSlope(t, logprob, ratio, in.advantage, in.ref_logprob));
  } else {
    r.loss = cross_entropy();
    r.factors = GradFactorsOf(o, lse, v);
  }
  if (t.entropy_coef != 0.0f) r.loss += EntropyTerm(static_cast<T>(t.entropy_coef), entropy);
  return r;
}

}  // namespace losshead::kernels::loss

#endif  // LOSSHEAD_KERNELS_COMMON_LOSS_MATH_H_
