#include "losshead/kernels/step_bound.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/common/loss_math.h"

namespace losshead::kernels {
namespace {

constexpr double kUnbounded = std::numeric_limits<double>::infinity();
// Room for the roundings of the sums behind a bounded value (WithinRange).
constexpr double kSumRoundingRoom = 2.0;

// A product of bounds; 0 * Inf (NaN in fp32) is Inf.
double BoundProduct(double a, double b) {
  return (std::isinf(a) || std::isinf(b)) ? kUnbounded : a * b;
}

std::string Short(double x) { return absl::StrFormat("%.3g", x); }

// The options that scale the bounds, as a refusal names them.
std::string ScalingOptions(const LossOptions& o) {
  const char* reduction = o.reduction == Reduction::kMean  ? "mean"
                          : o.reduction == Reduction::kSum ? "sum"
                                                           : "none";
  std::string out = absl::StrCat("grad_scale ", Short(o.grad_scale), ", z_loss ", Short(o.z_loss),
                                 ", softcap ", Short(o.softcap), ", reduction ", reduction);
  if (o.logit_scale != 1.0f) absl::StrAppend(&out, ", logit_scale ", Short(o.logit_scale));
  if (o.entropy_coef != 0.0f) absl::StrAppend(&out, ", entropy_coef ", Short(o.entropy_coef));
  if (o.kind == LossKind::kPolicyGradient) {
    absl::StrAppend(&out, ", kind policy_gradient, clip_high ", Short(o.clip_high), ", kl_coef ",
                    Short(o.kl_coef));
  }
  return out;
}

}  // namespace

double KlSlopeBound() {
  static const double bound = std::max(1.0, std::exp(loss::KlClampRoot()) - 1.0);
  return bound;
}

double DTypeMax(DType dtype) {
  switch (dtype) {
    case DType::kFP16:
      return 65504.0;
    case DType::kBF16:
      return 3.3895313892515355e38;
    case DType::kFP32:
      break;
  }
  return std::numeric_limits<float>::max();
}

bool WithinRange(double value, DType dtype) {
  return value * kSumRoundingRoom <= DTypeMax(dtype);  // NaN compares false: out of range
}

StepBounds BoundStep(const Problem& problem, double hidden_abs, double weight_abs,
                     int64_t counted_tokens, const TermInputBounds& terms) {
  const LossOptions& o = problem.options;
  StepBounds b;
  const double scale = o.logit_scale;
  b.logit = BoundProduct(
      BoundProduct(BoundProduct(static_cast<double>(problem.d), hidden_abs), weight_abs), scale);
  const double z = o.softcap > 0.0f ? std::min(b.logit, static_cast<double>(o.softcap)) : b.logit;
  const double log_v = std::log(static_cast<double>(problem.v));
  const double lse = z + log_v;
  const double z_loss = o.z_loss;
  const double spread = 2.0 * z + log_v;  // |log p_t| and |H_t| as computed
  const double entropy = std::abs(static_cast<double>(o.entropy_coef));
  double token_loss = BoundProduct(z_loss, BoundProduct(lse, lse));
  double slope = 1.0;  // |dloss_t / dlog p_t|
  if (entropy > 0.0) token_loss += BoundProduct(entropy, spread);
  if (o.kind == LossKind::kPolicyGradient) {
    const double ratio = std::exp(terms.old_logprob_neg);
    const double clipped =
        BoundProduct(terms.advantage_abs, std::max(ratio, 1.0 + static_cast<double>(o.clip_high)));
    token_loss += clipped;
    slope = BoundProduct(terms.advantage_abs, ratio);
    if (o.kl_coef > 0.0f) {
      // The clamped k3 (loss_math.h): at most kKlClamp, its slope at most exp(d*) - 1 where it
      // passes, whatever log p and q are.
      const double kl = static_cast<double>(o.kl_coef);
      token_loss += BoundProduct(kl, loss::kKlClamp);
      slope += BoundProduct(kl, KlSlopeBound());
    }
  } else {
    token_loss += spread;
  }
  token_loss = BoundProduct(terms.weight_abs, token_loss);
  const double counted = static_cast<double>(std::max<int64_t>(counted_tokens, 0));
  b.loss_sum = BoundProduct(counted, token_loss);
  b.grad = 2.0 * slope + 2.0 * BoundProduct(z_loss, lse);
  if (entropy > 0.0) b.grad += 2.0 * BoundProduct(entropy, z);
  b.grad = BoundProduct(BoundProduct(terms.weight_abs, std::max(1.0, scale)), b.grad);
  const double reduce = std::abs(static_cast<double>(o.grad_scale)) /
                        (o.reduction == Reduction::kMean ? std::max(counted, 1.0) : 1.0);
  b.scaled_grad = BoundProduct(reduce, b.grad);
  b.grad_hidden = BoundProduct(b.scaled_grad, weight_abs);
  b.grad_weight = BoundProduct(BoundProduct(counted, b.scaled_grad), hidden_abs);
  return b;
}

absl::Status CheckStepBounds(const Problem& problem, const StepBounds& b, double hidden_abs,
                             double weight_abs, DType grad_hidden_dtype, bool grad_weight) {
  const auto refuse = [&](absl::string_view what, double value, DType dtype) {
    return absl::OutOfRangeError(
        absl::StrCat("this micro-batch could overflow: hidden values up to ", Short(hidden_abs),
                     " with weights up to ", Short(weight_abs), " (", problem.d, " columns, ",
                     ScalingOptions(problem.options), ") bound ", what, " by ", Short(value),
                     ", past ", DTypeName(dtype), "'s ", Short(DTypeMax(dtype)),
                     "; it would compute Inf or NaN, so nothing was computed or counted"));
  };
  if (!WithinRange(b.logit, DType::kFP32)) return refuse("the logits", b.logit, DType::kFP32);
  if (!WithinRange(b.loss_sum, DType::kFP32)) {
    return refuse("the loss", b.loss_sum, DType::kFP32);
  }
  if (!WithinRange(b.grad, problem.dtype)) {
    return refuse("the logit gradient", b.grad, problem.dtype);
  }
  if (!WithinRange(b.scaled_grad, DType::kFP32)) {
    return refuse("the scaled logit gradient", b.scaled_grad, DType::kFP32);
  }
  for (DType dtype : {problem.dtype, grad_hidden_dtype}) {
    if (!WithinRange(b.grad_hidden, dtype)) return refuse("dH", b.grad_hidden, dtype);
  }
  if (grad_weight && !WithinRange(b.grad_weight, DType::kFP32)) {
    return refuse("its part of dW", b.grad_weight, DType::kFP32);
  }
  return absl::OkStatus();
}

double BoundEmbeddingGrad(double row_abs, int64_t max_repeats) {
  return row_abs * static_cast<double>(max_repeats);
}

}  // namespace losshead::kernels
