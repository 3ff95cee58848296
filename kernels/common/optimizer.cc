// Validation of an optimizer step and the fp32 constants it derives; no memory is touched.
#include "losshead/kernels/optimizer.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/common/optimizer_math.h"

namespace losshead::kernels {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule, double value) {
  return absl::InvalidArgumentError(absl::StrCat(field, " must be ", rule, ", got ", value));
}

absl::Status CheckLr(absl::string_view field, float lr) {
  if (!std::isfinite(lr) || lr < 0.0f) return Invalid(field, "finite and >= 0", lr);
  return absl::OkStatus();
}

absl::Status CheckWeightDecay(absl::string_view field, float weight_decay) {
  if (!std::isfinite(weight_decay) || weight_decay < 0.0f) {
    return Invalid(field, "finite and >= 0", weight_decay);
  }
  return absl::OkStatus();
}

// [0, 1), or [0, 1] when `closed`. NaN fails both comparisons and is refused too.
absl::Status CheckBeta(absl::string_view field, float beta, bool closed) {
  const bool ok = beta >= 0.0f && (closed ? beta <= 1.0f : beta < 1.0f);
  if (!ok) return Invalid(field, closed ? "in [0, 1]" : "in [0, 1)", beta);
  return absl::OkStatus();
}

absl::Status CheckOptions(const AdamWOptions& o) {
  if (absl::Status s = CheckLr("adamw.lr", o.lr); !s.ok()) return s;
  if (absl::Status s = CheckBeta("adamw.beta1", o.beta1, false); !s.ok()) return s;
  if (absl::Status s = CheckBeta("adamw.beta2", o.beta2, false); !s.ok()) return s;
  if (!std::isfinite(o.eps) || o.eps <= 0.0f) return Invalid("adamw.eps", "finite and > 0", o.eps);
  return CheckWeightDecay("adamw.weight_decay", o.weight_decay);
}

absl::Status CheckOptions(const SgdOptions& o) {
  if (absl::Status s = CheckLr("sgd.lr", o.lr); !s.ok()) return s;
  if (!std::isfinite(o.momentum) || o.momentum < 0.0f) {
    return Invalid("sgd.momentum", "finite and >= 0", o.momentum);
  }
  if (!std::isfinite(o.dampening)) return Invalid("sgd.dampening", "finite", o.dampening);
  if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sgd.nesterov needs momentum > 0 and dampening = 0, got momentum ", o.momentum,
                     " and dampening ", o.dampening));
  }
  return CheckWeightDecay("sgd.weight_decay", o.weight_decay);
}

absl::Status CheckOptions(const LionOptions& o) {
  if (absl::Status s = CheckLr("lion.lr", o.lr); !s.ok()) return s;
  if (absl::Status s = CheckBeta("lion.beta1", o.beta1, true); !s.ok()) return s;
  if (absl::Status s = CheckBeta("lion.beta2", o.beta2, true); !s.ok()) return s;
  return CheckWeightDecay("lion.weight_decay", o.weight_decay);
}

}  // namespace

OptimizerKind KindOf(const OptimizerOptions& options) {
  if (std::holds_alternative<SgdOptions>(options)) return OptimizerKind::kSgd;
  if (std::holds_alternative<LionOptions>(options)) return OptimizerKind::kLion;
  return OptimizerKind::kAdamW;
}

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

int StateBufferCount(OptimizerKind kind) { return kind == OptimizerKind::kAdamW ? 2 : 1; }

uint64_t OptimizerStateBytes(OptimizerKind kind, DType dtype, int64_t count) {
  const uint64_t buffers = StateBufferCount(kind) + (dtype == DType::kFP32 ? 0 : 1);
  return buffers * static_cast<uint64_t>(count < 0 ? 0 : count) * sizeof(float);
}

absl::Status ValidateOptimizerProblem(const OptimizerProblem& problem) {
  if (problem.count < 1) return Invalid("count", ">= 1", static_cast<double>(problem.count));
  if (problem.step < 1) return Invalid("step", ">= 1", static_cast<double>(problem.step));
  if (!std::isfinite(problem.grad_scale))
    return Invalid("grad_scale", "finite", problem.grad_scale);
  return std::visit([](const auto& options) { return CheckOptions(options); }, problem.options);
}

absl::Status ValidateOptimizerStep(const OptimizerProblem& problem,
                                   const OptimizerTensors& tensors) {
  if (absl::Status s = ValidateOptimizerProblem(problem); !s.ok()) return s;
  const bool fp32 = problem.dtype == DType::kFP32;
  const OptimizerKind kind = KindOf(problem.options);
  const bool momentum =
      kind == OptimizerKind::kSgd && std::get<SgdOptions>(problem.options).momentum != 0.0f;
  struct Buffer {
    const char* name;
    const void* data;
    size_t element;
    bool required;
    bool used;
  };
  const std::vector<Buffer> buffers = {
      {"weight", tensors.weight, DTypeSize(problem.dtype), true, true},
      {"master", tensors.master, sizeof(float), !fp32, !fp32},
      {"grad", tensors.grad, sizeof(float), true, true},
      {"exp_avg", tensors.exp_avg, sizeof(float), kind != OptimizerKind::kSgd,
       kind != OptimizerKind::kSgd},
      {"exp_avg_sq", tensors.exp_avg_sq, sizeof(float), kind == OptimizerKind::kAdamW,
       kind == OptimizerKind::kAdamW},
      {"momentum_buffer", tensors.momentum_buffer, sizeof(float), momentum, momentum},
  };
  if (fp32 && tensors.master != nullptr) {
    return absl::InvalidArgumentError("master must be null for fp32 weights: they are the master");
  }
  for (const Buffer& b : buffers) {
    if (b.required && b.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(b.name, " must not be null for ",
                                                     OptimizerKindName(kind), " with ",
                                                     DTypeName(problem.dtype), " weights"));
    }
  }
  // Buffers this step reads or writes must not overlap: the update would read its own output.
  const uint64_t count = static_cast<uint64_t>(problem.count);
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (size_t j = i + 1; j < buffers.size(); ++j) {
      const Buffer& a = buffers[i];
      const Buffer& b = buffers[j];
      if (!a.used || !b.used) continue;
      const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.data);
      const uintptr_t b0 = reinterpret_cast<uintptr_t>(b.data);
      if (a0 < b0 + count * b.element && b0 < a0 + count * a.element) {
        return absl::InvalidArgumentError(absl::StrCat(a.name, " and ", b.name, " overlap"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSquaredNorm(const float* data, int64_t count, const double* result) {
  if (count < 0) return Invalid("count", ">= 0", static_cast<double>(count));
  if (result == nullptr) return absl::InvalidArgumentError("result must not be null");
  if (data == nullptr && count > 0) {
    return absl::InvalidArgumentError("data must not be null when count > 0");
  }
  return absl::OkStatus();
}

namespace optim {
namespace {

void SetAdamW(const AdamWOptions& o, int64_t step, StepScalars& s) {
  const double lr = o.lr, beta1 = o.beta1, beta2 = o.beta2, t = static_cast<double>(step);
  s.decay = static_cast<float>(1.0 - lr * static_cast<double>(o.weight_decay));
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_rest = 1.0f - s.lerp_weight;
  s.lerp_small = std::abs(s.lerp_weight) < 0.5f;
  s.beta2 = o.beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, t))));
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
  s.eps = o.eps;
}

void SetSgd(const SgdOptions& o, StepScalars& s) {
  s.neg_lr = -o.lr;
  s.weight_decay = o.weight_decay;
  s.sgd_weight_decay = o.weight_decay != 0.0f;
  s.momentum = o.momentum;
  s.sgd_momentum = o.momentum != 0.0f;
  s.dampening_keep = static_cast<float>(1.0 - static_cast<double>(o.dampening));
  s.nesterov = o.nesterov;
  s.init_momentum_buffer = o.init_momentum_buffer;
}

void SetLion(const LionOptions& o, StepScalars& s) {
  const double lr = o.lr;
  s.decay = static_cast<float>(1.0 - lr * static_cast<double>(o.weight_decay));
  s.neg_lr = -o.lr;
  s.beta1 = o.beta1;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(o.beta1));
  s.beta2 = o.beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(o.beta2));
}

}  // namespace

StepScalars MakeStepScalars(const OptimizerProblem& problem) {
  StepScalars s;
  s.grad_scale = problem.grad_scale;
  if (const auto* o = std::get_if<AdamWOptions>(&problem.options)) SetAdamW(*o, problem.step, s);
  if (const auto* o = std::get_if<SgdOptions>(&problem.options)) SetSgd(*o, s);
  if (const auto* o = std::get_if<LionOptions>(&problem.options)) SetLion(*o, s);
  return s;
}

}  // namespace optim
}  // namespace losshead::kernels
