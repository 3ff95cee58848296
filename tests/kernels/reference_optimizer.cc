#include "tests/kernels/reference_optimizer.h"

#include <cmath>

namespace losshead::kernels::testing {
namespace {

void AdamW(const AdamWOptions& o, double grad_scale, int64_t step, const std::vector<float>& grad,
           ReferenceOptimizerState& s) {
  const double lr = o.lr, b1 = o.beta1, b2 = o.beta2, eps = o.eps, wd = o.weight_decay;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] * grad_scale;
    double& p = s.param[i];
    double& m = s.a[i];
    double& v = s.b[i];
    p *= 1.0 - lr * wd;
    m = b1 * m + (1.0 - b1) * g;
    v = b2 * v + (1.0 - b2) * g * g;
    p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
  }
}

void Sgd(const SgdOptions& o, double grad_scale, const std::vector<float>& grad,
         ReferenceOptimizerState& s) {
  const double lr = o.lr, mu = o.momentum, dampening = o.dampening, wd = o.weight_decay;
  for (size_t i = 0; i < grad.size(); ++i) {
    double& p = s.param[i];
    double d = grad[i] * grad_scale + wd * p;
    if (mu != 0.0) {
      double& buf = s.a[i];
      buf = s.momentum_buffer_set ? mu * buf + (1.0 - dampening) * d : d;
      d = o.nesterov ? d + mu * buf : buf;
    }
    p -= lr * d;
  }
  if (mu != 0.0) s.momentum_buffer_set = true;
}

void Lion(const LionOptions& o, double grad_scale, const std::vector<float>& grad,
          ReferenceOptimizerState& s) {
  const double lr = o.lr, b1 = o.beta1, b2 = o.beta2, wd = o.weight_decay;
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] * grad_scale;
    double& p = s.param[i];
    double& m = s.a[i];
    const double c = b1 * m + (1.0 - b1) * g;
    p *= 1.0 - lr * wd;
    p -= lr * ((c > 0.0) - (c < 0.0));
    m = b2 * m + (1.0 - b2) * g;
  }
}

}  // namespace

void ReferenceOptimizerStep(const OptimizerOptions& options, double grad_scale, int64_t step,
                            const std::vector<float>& grad, ReferenceOptimizerState* state) {
  state->a.resize(grad.size(), 0.0);
  state->b.resize(grad.size(), 0.0);
  if (const auto* o = std::get_if<AdamWOptions>(&options))
    AdamW(*o, grad_scale, step, grad, *state);
  if (const auto* o = std::get_if<SgdOptions>(&options)) Sgd(*o, grad_scale, grad, *state);
  if (const auto* o = std::get_if<LionOptions>(&options)) Lion(*o, grad_scale, grad, *state);
}

}  // namespace losshead::kernels::testing
