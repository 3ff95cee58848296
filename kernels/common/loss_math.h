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

// The CPU backend's fp32 factors: unscaled double factors f with 1 / p_divisor folded into p_scale
// and `scale` into all three, each rounded once (p_divisor = 1 divides exactly).
inline GradFactors FoldedGradFactors(const BasicGradFactors<double>& f, double p_divisor,
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

}  // namespace losshead::kernels::loss

#endif  // LOSSHEAD_KERNELS_COMMON_LOSS_MATH_H_
