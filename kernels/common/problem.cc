#include "losshead/kernels/problem.h"

#include <cmath>

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
  return absl::OkStatus();
}

}  // namespace losshead::kernels
