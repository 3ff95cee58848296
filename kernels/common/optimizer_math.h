// The per-element update rules of the optimizers, shared by the CPU and CUDA backends so that both
// compute the same bits: every fp32 operation is rounded on its own, in torch's order of
// evaluation. nvcc would otherwise fuse a * b + c into one FMA where the host compiler does not
// (the CPU files build with -ffp-contract=off for the same reason).
#ifndef LOSSHEAD_KERNELS_COMMON_OPTIMIZER_MATH_H_
#define LOSSHEAD_KERNELS_COMMON_OPTIMIZER_MATH_H_

#include <cmath>

#include "losshead/kernels/optimizer.h"

#if defined(__CUDACC__)
#define LOSSHEAD_HD __host__ __device__ __forceinline__
#else
#define LOSSHEAD_HD inline
#endif

namespace losshead::kernels::optim {

LOSSHEAD_HD float Mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LOSSHEAD_HD float Add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LOSSHEAD_HD float Sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

LOSSHEAD_HD float Div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

LOSSHEAD_HD float Sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The fp32 constants of one step, derived on the host in fp64 as torch does with its Python-float
// hyper-parameters, then rounded to fp32 as torch's tensor-scalar ops round them.
struct StepScalars {
  float grad_scale = 1.0f;
  float decay = 1.0f;            // AdamW, Lion: 1 - lr * weight_decay
  float lerp_weight = 0.0f;      // AdamW: 1 - beta1
  float lerp_rest = 1.0f;        // AdamW: 1 - lerp_weight, in fp32
  bool lerp_small = true;        // AdamW: |lerp_weight| < 0.5 picks torch's lerp formula
  float beta1 = 0.0f;            // Lion
  float one_minus_beta1 = 0.0f;  // Lion
  float beta2 = 0.0f;            // AdamW, Lion
  float one_minus_beta2 = 0.0f;  // AdamW, Lion
  float neg_step_size = 0.0f;    // AdamW: -lr / (1 - beta1^t)
  float bc2_sqrt = 1.0f;         // AdamW: sqrt(1 - beta2^t)
  float eps = 0.0f;              // AdamW
  float neg_lr = 0.0f;           // SGD, Lion
  float weight_decay = 0.0f;     // SGD (added to the gradient)
  float momentum = 0.0f;         // SGD
  float dampening_keep = 1.0f;   // SGD: 1 - dampening
  bool sgd_weight_decay = false;
  bool sgd_momentum = false;
  bool nesterov = false;
  bool init_momentum_buffer = false;
};

// `problem` must have passed ValidateOptimizerProblem.
StepScalars MakeStepScalars(const OptimizerProblem& problem);

// Each rule updates the fp32 parameter p and up to two state values (a, b) from one raw
// gradient value. kStates says how many of a, b it reads and writes.
struct AdamWRule {
  static constexpr int kStates = 2;  // a = exp_avg, b = exp_avg_sq
  LOSSHEAD_HD static void Apply(const StepScalars& s, float grad, float& p, float& a, float& b) {
    const float g = Mul(grad, s.grad_scale);
    p = Mul(p, s.decay);
    // torch's lerp: the form that stays exact at the end the weight is nearer to.
    a = s.lerp_small ? Add(a, Mul(s.lerp_weight, Sub(g, a))) : Sub(g, Mul(Sub(g, a), s.lerp_rest));
    b = Add(Mul(b, s.beta2), Mul(Mul(s.one_minus_beta2, g), g));
    const float denom = Add(Div(Sqrt(b), s.bc2_sqrt), s.eps);
    p = Add(p, Div(Mul(s.neg_step_size, a), denom));
  }
};

struct SgdRule {
  static constexpr int kStates = 1;  // a = momentum_buffer (only when momentum != 0)
  LOSSHEAD_HD static void Apply(const StepScalars& s, float grad, float& p, float& a,
                                float& /*b*/) {
    float d = Mul(grad, s.grad_scale);
    if (s.sgd_weight_decay) d = Add(d, Mul(s.weight_decay, p));
    if (s.sgd_momentum) {
      a = s.init_momentum_buffer ? d : Add(Mul(a, s.momentum), Mul(s.dampening_keep, d));
      d = s.nesterov ? Add(d, Mul(s.momentum, a)) : a;
    }
    p = Add(p, Mul(s.neg_lr, d));
  }
};

struct LionRule {
  static constexpr int kStates = 1;  // a = exp_avg
  LOSSHEAD_HD static void Apply(const StepScalars& s, float grad, float& p, float& a,
                                float& /*b*/) {
    const float g = Mul(grad, s.grad_scale);
    p = Mul(p, s.decay);
    const float c = Add(Mul(a, s.beta1), Mul(s.one_minus_beta1, g));
    // sign(c); zero and NaN pass through as themselves, as torch.sign does.
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);
    p = Add(p, Mul(s.neg_lr, sign));
    a = Add(Mul(a, s.beta2), Mul(s.one_minus_beta2, g));
  }
};

}  // namespace losshead::kernels::optim

#endif  // LOSSHEAD_KERNELS_COMMON_OPTIMIZER_MATH_H_
