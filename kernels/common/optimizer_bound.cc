// How large one optimizer step can make the weights and the state, from bounds on what it reads.
// An apply asks this first: when the bound stays within the head's dtype, the step cannot
// overflow and the read-only pass of Backend::CheckOptimizerStep is skipped.
//
// Every term is the magnitude of one fp32 operation of optimizer_math.h's rules, taken in fp64
// over the largest inputs. An fp32 result exceeds its exact value by at most 2^-24 relative per
// rounding and a rule rounds fewer than 16 times, so the final factor kRoundingSlack covers them.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/common/optimizer_math.h"
#include "losshead/kernels/optimizer.h"

namespace losshead::kernels {
namespace {

constexpr double kRoundingSlack = 1.0 + 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kFp32Max = std::numeric_limits<float>::max();

// |x| in fp64; NaN (a scalar such as 0 * Inf that the step would also produce) reads as +Inf.
double Mag(double x) { return std::isnan(x) ? kInf : std::abs(x); }

// The bound of an fp32 result: +Inf where the result may overflow fp32 (allowing for the
// roundings before it), since everything computed from an Inf is Inf or NaN.
double Fp32(double x) { return x * kRoundingSlack > kFp32Max ? kInf : x; }

// Bounds of an fp32 product and sum of values within a and b; 0 * Inf (NaN in fp32) is Inf.
double Mul(double a, double b) {
  if (std::isinf(a) || std::isinf(b)) return kInf;
  return Fp32(a * b);
}
double Sum(double a, double b) { return Fp32(a + b); }

OptimizerMagnitudes AdamW(const optim::StepScalars& s, const OptimizerMagnitudes& in, double g) {
  OptimizerMagnitudes out;
  // exp_avg: a lerp between m and g, within the larger of them; torch's formula rounds g - m
  // first, which may be twice that.
  out.state_a = Sum(in.state_a, g) < kInf ? std::max(in.state_a, g) : kInf;
  out.state_b = Sum(Mul(in.state_b, Mag(s.beta2)), Mul(Mul(Mag(s.one_minus_beta2), g), g));
  // The denominator sqrt(v) / bc2 + eps is at least eps > 0 (an Inf one makes the move 0); the
  // numerator step_size * m is rounded on its own before the division.
  const double numerator = Mul(Mag(s.neg_step_size), out.state_a);
  const double update = Fp32(numerator / static_cast<double>(s.eps));
  out.weight = Sum(Mul(in.weight, Mag(s.decay)), update);
  return out;
}

OptimizerMagnitudes Sgd(const optim::StepScalars& s, const OptimizerMagnitudes& in, double g) {
  OptimizerMagnitudes out;
  double d = s.sgd_weight_decay ? Sum(g, Mul(Mag(s.weight_decay), in.weight)) : g;
  out.state_a = in.state_a;  // untouched without momentum
  if (s.sgd_momentum) {
    out.state_a = s.init_momentum_buffer
                      ? d
                      : Sum(Mul(in.state_a, Mag(s.momentum)), Mul(Mag(s.dampening_keep), d));
    d = s.nesterov ? Sum(d, Mul(Mag(s.momentum), out.state_a)) : out.state_a;
  }
  out.state_b = in.state_b;
  out.weight = Sum(in.weight, Mul(Mag(s.neg_lr), d));
  return out;
}

OptimizerMagnitudes Lion(const optim::StepScalars& s, const OptimizerMagnitudes& in, double g) {
  OptimizerMagnitudes out;
  // beta1 * m + (1 - beta1) * g only gives a sign (an Inf one too); the new m mixes m and g.
  out.state_a = Sum(Mul(Mag(s.beta2), in.state_a), Mul(Mag(s.one_minus_beta2), g));
  out.state_b = in.state_b;
  out.weight = Sum(Mul(in.weight, Mag(s.decay)), Mag(s.neg_lr));
  return out;
}

}  // namespace

OptimizerMagnitudes StepMagnitudeBound(const OptimizerProblem& problem,
                                       const OptimizerMagnitudes& before, double grad_abs) {
  const optim::StepScalars s = optim::MakeStepScalars(problem);
  const double g = Mul(Mag(grad_abs), Mag(s.grad_scale));
  OptimizerMagnitudes out;
  switch (KindOf(problem.options)) {
    case OptimizerKind::kAdamW:
      out = AdamW(s, before, g);
      break;
    case OptimizerKind::kSgd:
      out = Sgd(s, before, g);
      break;
    case OptimizerKind::kLion:
      out = Lion(s, before, g);
      break;
  }
  out.weight *= kRoundingSlack;
  out.state_a *= kRoundingSlack;
  out.state_b *= kRoundingSlack;
  return out;
}

bool StepStaysInRange(DType dtype, const OptimizerMagnitudes& after) {
  double weight_max = kFp32Max;
  if (dtype == DType::kFP16) weight_max = 65504.0;
  // The largest finite bf16, 0x7f7f; anything from there to fp32's max rounds within a half step
  // of it or to Inf, so this is the safe side.
  if (dtype == DType::kBF16) weight_max = 3.3895313892515355e38;
  // NaN compares false: out of range.
  return after.weight <= weight_max && after.state_a <= kFp32Max && after.state_b <= kFp32Max;
}

}  // namespace losshead::kernels
