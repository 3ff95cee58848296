#include "losshead/kernels/problem.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace losshead::kernels {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
      return 4;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return "unknown";
}

absl::string_view MatmulPrecisionName(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kHighest:
      return "highest";
    case MatmulPrecision::kHigh:
      return "high";
    case MatmulPrecision::kMedium:
      return "medium";
  }
  return "unknown";
}

absl::Status ValidateProblem(const Problem& problem) {
  if (problem.n < 1) {
    return absl::InvalidArgumentError(absl::StrCat("n must be >= 1, got ", problem.n));
  }
  if (problem.d < 1) {
    return absl::InvalidArgumentError(absl::StrCat("d must be >= 1, got ", problem.d));
  }
  if (problem.v < 1) {
    return absl::InvalidArgumentError(absl::StrCat("v must be >= 1, got ", problem.v));
  }
  if (problem.v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("v must fit in int32, got ", problem.v));
  }
  if (problem.precision != MatmulPrecision::kHighest &&
      problem.precision != MatmulPrecision::kHigh &&
      problem.precision != MatmulPrecision::kMedium) {
    return absl::InvalidArgumentError(absl::StrCat(
        "precision must be highest, high or medium, got ", static_cast<int>(problem.precision)));
  }
  if (problem.precision != MatmulPrecision::kHighest && problem.dtype != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "precision ", MatmulPrecisionName(problem.precision), " applies to fp32 problems only: a ",
        DTypeName(problem.dtype), " problem's products are exact in fp32 (highest)"));
  }
  const LossOptions& o = problem.options;
  if (!std::isfinite(o.grad_scale)) {
    return absl::InvalidArgumentError("grad_scale must be finite");
  }
  if (!(o.label_smoothing >= 0.0f && o.label_smoothing < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label_smoothing must be in [0, 1), got ", o.label_smoothing));
  }
  if (!(o.z_loss >= 0.0f) || !std::isfinite(o.z_loss)) {
    return absl::InvalidArgumentError(
        absl::StrCat("z_loss must be finite and >= 0, got ", o.z_loss));
  }
  if (!ValidSoftcap(o.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap must be ", kSoftcapRange, ", got ", o.softcap));
  }
  if (!(o.logit_scale > 0.0f) || !std::isfinite(o.logit_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_scale must be finite and > 0, got ", o.logit_scale));
  }
  if (!std::isfinite(o.entropy_coef)) {
    return absl::InvalidArgumentError(
        absl::StrCat("entropy_coef must be finite, got ", o.entropy_coef));
  }
  if (o.kind != LossKind::kCrossEntropy && o.kind != LossKind::kPolicyGradient) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind must be cross_entropy or policy_gradient, got ", static_cast<int>(o.kind)));
  }
  if (!(o.clip_low >= 0.0f && o.clip_low <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("clip_low must be in [0, 1], got ", o.clip_low));
  }
  if (!(o.clip_high >= 0.0f) || !std::isfinite(o.clip_high)) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_high must be finite and >= 0, got ", o.clip_high));
  }
  if (!(o.kl_coef >= 0.0f) || !std::isfinite(o.kl_coef)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kl_coef must be finite and >= 0, got ", o.kl_coef));
  }
  if (o.kind == LossKind::kCrossEntropy && o.kl_coef != 0.0f) {
    return absl::InvalidArgumentError("kl_coef applies to kind policy_gradient only");
  }
  if (o.kind == LossKind::kPolicyGradient && o.label_smoothing != 0.0f) {
    return absl::InvalidArgumentError(
        "label_smoothing applies to kind cross_entropy only, not policy_gradient");
  }
  return absl::OkStatus();
}

std::string RequestedLossTerms(const LossOptions& options) {
  std::string names;
  auto add = [&names](bool asked, absl::string_view name) {
    if (!asked) return;
    if (!names.empty()) names += ", ";
    names.append(name.data(), name.size());
  };
  add(options.logit_scale != 1.0f, "logit_scale");
  add(options.entropy_coef != 0.0f, "entropy_coef");
  add(options.kind == LossKind::kPolicyGradient, "kind=policy_gradient");
  return names;
}

absl::Status ValidateLossInputs(const Problem& problem, const Arguments& args) {
  const LossOptions& o = problem.options;
  if (args.grad_bias != nullptr && args.bias == nullptr) {
    return absl::InvalidArgumentError("grad_bias is given without bias");
  }
  const bool policy = o.kind == LossKind::kPolicyGradient;
  if (policy && (args.old_logprob == nullptr || args.advantages == nullptr)) {
    return absl::InvalidArgumentError("kind policy_gradient needs old_logprob and advantages");
  }
  if (!policy && (args.old_logprob != nullptr || args.advantages != nullptr)) {
    return absl::InvalidArgumentError(
        "old_logprob and advantages apply to kind policy_gradient only");
  }
  if (o.kl_coef > 0.0f && args.ref_logprob == nullptr) {
    return absl::InvalidArgumentError("kl_coef > 0 needs ref_logprob");
  }
  if (o.kl_coef == 0.0f && args.ref_logprob != nullptr) {
    return absl::InvalidArgumentError("ref_logprob is given but kl_coef is 0");
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels
