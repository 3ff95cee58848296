#include "server/engine/proto_convert.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace losshead::server {

absl::StatusOr<kernels::DType> FloatDType(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return kernels::DType::kBF16;
    case v1::DTYPE_FP16:
      return kernels::DType::kFP16;
    case v1::DTYPE_FP32:
      return kernels::DType::kFP32;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32, got ",
                       v1::DType_IsValid(dtype) ? v1::DType_Name(dtype)
                                                : absl::StrCat(static_cast<int>(dtype))));
  }
}

v1::DType ToProto(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kBF16:
      return v1::DTYPE_BF16;
    case kernels::DType::kFP16:
      return v1::DTYPE_FP16;
    case kernels::DType::kFP32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<kernels::MatmulPrecision> ToKernel(v1::MatmulPrecision precision,
                                                  kernels::DType dtype) {
  kernels::MatmulPrecision out = kernels::MatmulPrecision::kHighest;
  switch (precision) {
    case v1::MATMUL_PRECISION_UNSPECIFIED:
    case v1::MATMUL_PRECISION_HIGHEST:
      return out;
    case v1::MATMUL_PRECISION_HIGH:
      out = kernels::MatmulPrecision::kHigh;
      break;
    case v1::MATMUL_PRECISION_MEDIUM:
      out = kernels::MatmulPrecision::kMedium;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("matmul_precision must be MATMUL_PRECISION_HIGHEST, _HIGH or _MEDIUM, got ",
                       static_cast<int>(precision)));
  }
  if (dtype != kernels::DType::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("matmul_precision ", v1::MatmulPrecision_Name(precision),
                     " applies to DTYPE_FP32 heads only: a ", kernels::DTypeName(dtype),
                     " head's products are exact in fp32 already (leave it unset or HIGHEST)"));
  }
  return out;
}

v1::MatmulPrecision ToProto(kernels::MatmulPrecision precision) {
  switch (precision) {
    case kernels::MatmulPrecision::kHighest:
      return v1::MATMUL_PRECISION_HIGHEST;
    case kernels::MatmulPrecision::kHigh:
      return v1::MATMUL_PRECISION_HIGH;
    case kernels::MatmulPrecision::kMedium:
      return v1::MATMUL_PRECISION_MEDIUM;
  }
  return v1::MATMUL_PRECISION_UNSPECIFIED;
}

namespace {

absl::StatusOr<kernels::Reduction> ToKernel(v1::Reduction reduction, absl::string_view field) {
  switch (reduction) {
    case v1::REDUCTION_MEAN:
      return kernels::Reduction::kMean;
    case v1::REDUCTION_SUM:
      return kernels::Reduction::kSum;
    case v1::REDUCTION_NONE:
      return kernels::Reduction::kNone;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is not a known Reduction: ", static_cast<int>(reduction)));
  }
}

}  // namespace

absl::Status ValidateLossOptions(const v1::LossOptions& o) {
  if (o.reduction() != v1::REDUCTION_UNSPECIFIED) {
    absl::Status s = ToKernel(o.reduction(), "reduction").status();
    if (!s.ok()) return s;
  }
  if (o.has_label_smoothing() && !(o.label_smoothing() >= 0.0f && o.label_smoothing() < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label_smoothing must be in [0, 1), got ", o.label_smoothing()));
  }
  if (o.has_z_loss() && !(o.z_loss() >= 0.0f && std::isfinite(o.z_loss()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("z_loss must be finite and >= 0, got ", o.z_loss()));
  }
  if (o.has_logit_softcap() && !kernels::ValidSoftcap(o.logit_softcap())) {
    return absl::InvalidArgumentError(absl::StrCat("logit_softcap must be ", kernels::kSoftcapRange,
                                                   ", got ", o.logit_softcap()));
  }
  if (o.has_logit_scale() && !(o.logit_scale() > 0.0f && std::isfinite(o.logit_scale()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_scale must be finite and > 0, got ", o.logit_scale()));
  }
  if (o.has_temperature() && !(o.temperature() > 0.0f && std::isfinite(o.temperature()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and > 0, got ", o.temperature()));
  }
  if (o.has_entropy_coef() && !std::isfinite(o.entropy_coef())) {
    return absl::InvalidArgumentError(
        absl::StrCat("entropy_coef must be finite, got ", o.entropy_coef()));
  }
  if (o.kind() != v1::LOSS_KIND_UNSPECIFIED && o.kind() != v1::LOSS_KIND_CROSS_ENTROPY &&
      o.kind() != v1::LOSS_KIND_POLICY_GRADIENT) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind is not a known LossKind: ", static_cast<int>(o.kind())));
  }
  if (o.has_clip_low() && !(o.clip_low() >= 0.0f && o.clip_low() <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_low must be in [0, 1], got ", o.clip_low()));
  }
  if (o.has_clip_high() && !(o.clip_high() >= 0.0f && std::isfinite(o.clip_high()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_high must be finite and >= 0, got ", o.clip_high()));
  }
  if (o.has_kl_coef() && !(o.kl_coef() >= 0.0f && std::isfinite(o.kl_coef()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("kl_coef must be finite and >= 0, got ", o.kl_coef()));
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::LossOptions> ResolveLossOptions(const v1::LossOptions& request,
                                                        const v1::LossOptions& head_default,
                                                        const v1::StepOptions* step) {
  if (absl::Status s = ValidateLossOptions(request); !s.ok()) return s;
  kernels::LossOptions out;
  float temperature = 1.0f;
  // Later layers win: built-in, then the head's default, then the request.
  for (const v1::LossOptions* layer : {&head_default, &request}) {
    if (layer->has_ignore_index()) out.ignore_index = layer->ignore_index();
    if (layer->reduction() != v1::REDUCTION_UNSPECIFIED) {
      auto r = ToKernel(layer->reduction(), "loss_options.reduction");
      if (!r.ok()) return r.status();
      out.reduction = *r;
    }
    if (layer->has_label_smoothing()) out.label_smoothing = layer->label_smoothing();
    if (layer->has_z_loss()) out.z_loss = layer->z_loss();
    if (layer->has_logit_softcap()) out.softcap = layer->logit_softcap();
    if (layer->has_logit_scale()) out.logit_scale = layer->logit_scale();
    if (layer->has_temperature()) temperature = layer->temperature();
    if (layer->has_entropy_coef()) out.entropy_coef = layer->entropy_coef();
    if (layer->kind() == v1::LOSS_KIND_CROSS_ENTROPY) out.kind = kernels::LossKind::kCrossEntropy;
    if (layer->kind() == v1::LOSS_KIND_POLICY_GRADIENT) {
      out.kind = kernels::LossKind::kPolicyGradient;
    }
    if (layer->has_clip_low()) out.clip_low = layer->clip_low();
    if (layer->has_clip_high()) out.clip_high = layer->clip_high();
    if (layer->has_kl_coef()) out.kl_coef = layer->kl_coef();
  }
  if (temperature != 1.0f) {
    // The kernels take one scale: the model's divided by the temperature, which must stay a
    // normal, finite fp32 number (a quotient that underflows would zero every logit).
    const float scale = out.logit_scale / temperature;
    if (!(scale >= std::numeric_limits<float>::min() && std::isfinite(scale))) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_scale / temperature = ", out.logit_scale, " / ", temperature,
                       " must be a normal, finite fp32 number, got ", scale));
    }
    out.logit_scale = scale;
  }
  if (step != nullptr) {
    if (step->reduction() != v1::REDUCTION_UNSPECIFIED) {
      auto r = ToKernel(step->reduction(), "options.reduction");
      if (!r.ok()) return r.status();
      out.reduction = *r;
    }
    if (step->has_grad_scale()) {
      if (!std::isfinite(step->grad_scale())) {
        return absl::InvalidArgumentError(
            absl::StrCat("options.grad_scale must be finite, got ", step->grad_scale()));
      }
      out.grad_scale = step->grad_scale();
    }
  }
  return out;
}

}  // namespace losshead::server
