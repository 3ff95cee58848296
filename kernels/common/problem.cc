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

absl::Status ValidateProblem(const Problem& problem) {
  if (problem.n < 1) return absl::InvalidArgumentError(absl::StrCat("n must be >= 1, got ", problem.n));
  if (problem.d < 1) return absl::InvalidArgumentError(absl::StrCat("d must be >= 1, got ", problem.d));
  if (problem.v < 1) return absl::InvalidArgumentError(absl::StrCat("v must be >= 1, got ", problem.v));
  if (problem.v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("v must fit in int32, got ", problem.v));
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
    return absl::InvalidArgumentError(absl::StrCat("z_loss must be finite and >= 0, got ", o.z_loss));
  }
  if (!ValidSoftcap(o.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap must be ", kSoftcapRange, ", got ", o.softcap));
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels
