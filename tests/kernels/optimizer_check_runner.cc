#include "tests/kernels/optimizer_check_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::testing {
namespace {

// A value of magnitude up to `reach` with a random sign: `reach` itself, zero, or log-uniform
// over the ten decades below it.
float Below(double reach, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double sign = unit(rng) < 0.5 ? -1.0 : 1.0;
  const double u = unit(rng);
  if (u < 0.05 || reach == 0.0) return 0.0f;
  if (u > 0.95) return static_cast<float>(sign * reach);
  return static_cast<float>(sign * reach * std::pow(10.0, -10.0 * unit(rng)));
}

float Signed(double magnitude, std::mt19937_64& rng) {
  return static_cast<float>((rng() & 1) != 0 ? magnitude : -magnitude);
}

bool UsesStateA(const OptimizerProblem& problem) {
  if (const auto* sgd = std::get_if<SgdOptions>(&problem.options)) return sgd->momentum != 0.0f;
  return true;
}

bool UsesStateB(const OptimizerProblem& problem) {
  return KindOf(problem.options) == OptimizerKind::kAdamW;
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

StepStart StartWithin(const OptimizerProblem& problem, const OptimizerMagnitudes& reach,
                      double grad_abs, std::mt19937_64& rng) {
  const int64_t n = problem.count;
  const double a_reach = UsesStateA(problem) ? reach.state_a : 0.0;
  const double b_reach = UsesStateB(problem) ? reach.state_b : 0.0;
  StepStart s;
  s.param.resize(n);
  s.grad.resize(n);
  s.state_a.resize(n);
  s.state_b.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    s.param[i] = Below(reach.weight, rng);
    s.grad[i] = Below(grad_abs, rng);
    s.state_a[i] = Below(a_reach, rng);
    s.state_b[i] = std::abs(Below(b_reach, rng));  // exp_avg_sq is never negative
  }
  for (int64_t i = 0; i < std::min<int64_t>(n, 2); ++i) {
    s.param[i] = Signed(reach.weight, rng);
    s.grad[i] = Signed(grad_abs, rng);
    s.state_a[i] = Signed(a_reach, rng);
    s.state_b[i] = i == 0 ? static_cast<float>(b_reach) : 0.0f;
  }
  return s;
}

CheckScenario MakeCheckScenario(const OptimizerCase& c, bool overflow, std::mt19937_64& rng) {
  CheckScenario s;
  s.problem = OptimizerProblem{.count = c.count(),
                               .dtype = c.dtype,
                               .options = c.options,
                               .grad_scale = c.grad_scale,
                               .step = 3};
  OptimizerMagnitudes reach{.weight = 1.0, .state_a = 0.0, .state_b = 0.01};
  if (overflow) {
    const float limit = c.dtype == DType::kFP16 ? 65504.0f : std::numeric_limits<float>::max();
    reach = {.weight = 0.9f * limit, .state_a = 0.1, .state_b = 0.01};
    const float lr = c.dtype == DType::kFP16 ? limit : 0.5f * limit;
    std::visit([lr](auto& o) { o.lr = lr; }, s.problem.options);
  }
  s.start = StartWithin(s.problem, reach, 100.0, rng);
  return s;
}

absl::StatusOr<CheckedStep> CheckThenStep(Backend& backend, const OptimizerProblem& problem,
                                          const StepStart& start, int64_t offset) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = backend.CreateStream();
  if (!stream.ok()) return stream.status();
  absl::StatusOr<StepBuffersOn> buffers = StepBuffersOn::Allocate(
      backend, KindOf(problem.options), problem.dtype, problem.count, offset);
  if (!buffers.ok()) return buffers.status();
  absl::StatusOr<DeviceBuffer> result = backend.Allocate(sizeof(OptimizerCheck));
  if (!result.ok()) return result.status();
  CheckedStep out;
  absl::Status s = buffers->Upload(start.param, start.grad, start.state_a, start.state_b, **stream);
  if (s.ok()) s = buffers->Download(&out.before, **stream);
  if (s.ok()) {
    s = backend.CheckOptimizerStep(problem, buffers->tensors, result->as<OptimizerCheck>(),
                                   **stream);
  }
  if (s.ok()) s = backend.CopyToHost(&out.check, result->data(), sizeof(OptimizerCheck), **stream);
  if (s.ok()) s = buffers->Download(&out.after_check, **stream);
  if (s.ok()) s = backend.OptimizerStep(problem, buffers->tensors, **stream);
  if (s.ok()) s = buffers->Download(&out.after_step, **stream);
  if (!s.ok()) return s;
  return out;
}

OptimizerCheck CheckFromStep(DType dtype, const OptimizerOutputs& after_step) {
  const size_t n = after_step.param.size();
  std::vector<float> rounded(n);
  ToFloat(dtype, after_step.weight.data(), rounded.data(), n);
  OptimizerCheck check;
  for (size_t i = 0; i < n; ++i) {
    const float p = after_step.param[i], a = after_step.state_a[i], b = after_step.state_b[i];
    const bool finite =
        std::isfinite(p) && std::isfinite(rounded[i]) && std::isfinite(a) && std::isfinite(b);
    check.nonfinite += finite ? 0 : 1;
    check.weight = std::fmax(check.weight, std::abs(p));
    check.state_a = std::fmax(check.state_a, std::abs(a));
    check.state_b = std::fmax(check.state_b, std::abs(b));
  }
  return check;
}

bool SameBits(const OptimizerOutputs& a, const OptimizerOutputs& b) {
  return SameFloats(a.param, b.param) && a.weight == b.weight && SameFloats(a.grad, b.grad) &&
         SameFloats(a.state_a, b.state_a) && SameFloats(a.state_b, b.state_b);
}

std::string Describe(const OptimizerCheck& check) {
  return absl::StrCat("{nonfinite ", check.nonfinite, ", weight ", check.weight, ", state_a ",
                      check.state_a, ", state_b ", check.state_b, "}");
}

}  // namespace losshead::kernels::testing
