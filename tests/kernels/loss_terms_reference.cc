#include "tests/kernels/loss_terms_reference.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace losshead::kernels::testing {
namespace {

// d minimum(a, b) / d(a, b) as PyTorch's autograd defines it: all to the smaller operand, half to
// each at a tie.
void MinimumBackward(double a, double b, double* da, double* db) {
  if (a == b) {
    *da = *db = 0.5;
  } else {
    *da = a < b ? 1.0 : 0.0;
    *db = a < b ? 0.0 : 1.0;
  }
}

}  // namespace

TermResult LossTermsReference(const Problem& problem, const std::vector<double>& hidden,
                              const std::vector<double>& weight,
                              const std::vector<int32_t>& targets, const TermInputs& inputs) {
  const int64_t n = problem.n, d = problem.d, v = problem.v;
  const LossOptions& o = problem.options;
  const double eps = o.label_smoothing, z_loss = o.z_loss, cap = o.softcap;
  const double scale = o.logit_scale, coef = o.entropy_coef;
  TermResult r;
  r.per_token_loss.assign(n, 0.0);
  r.per_token_lse.assign(n, 0.0);
  r.per_token_logprob.assign(n, 0.0);
  r.per_token_entropy.assign(n, 0.0);
  r.grad_hidden.assign(n * d, 0.0);
  r.grad_weight.assign(v * d, 0.0);
  r.grad_bias.assign(v, 0.0);
  for (int32_t t : targets) r.token_count += t == o.ignore_index ? 0 : 1;
  double reduction_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    reduction_scale = r.token_count > 0 ? reduction_scale / r.token_count : 0.0;
  }

  std::vector<double> x(v), z(v), p(v), dz(v);
  for (int64_t t = 0; t < n; ++t) {
    const double* h = &hidden[t * d];
    for (int64_t j = 0; j < v; ++j) {
      double u = 0.0;
      for (int64_t k = 0; k < d; ++k) u += h[k] * weight[j * d + k];
      x[j] = scale * u + (inputs.bias.empty() ? 0.0 : inputs.bias[j]);
      z[j] = cap > 0.0 ? cap * std::tanh(x[j] / cap) : x[j];
    }
    const double max_z = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - max_z);
    const double lse = max_z + std::log(sum);
    r.per_token_lse[t] = lse;
    const int32_t y = targets[t];
    if (y == o.ignore_index) continue;

    double mean_z = 0.0, expected_z = 0.0, entropy = 0.0;
    for (int64_t j = 0; j < v; ++j) {
      p[j] = std::exp(z[j] - lse);
      mean_z += z[j] / v;
      expected_z += p[j] * z[j];
      entropy -= p[j] * (z[j] - lse);  // -sum_j p_j log p_j
    }
    const double logprob = z[y] - lse;
    r.per_token_logprob[t] = logprob;
    r.per_token_entropy[t] = entropy;

    // The token's loss and dloss/dz, term by term.
    double loss = z_loss * lse * lse;
    for (int64_t j = 0; j < v; ++j) dz[j] = 2.0 * z_loss * lse * p[j];
    if (o.kind == LossKind::kCrossEntropy) {
      loss += (1.0 - eps) * -logprob + eps * (lse - mean_z);
      for (int64_t j = 0; j < v; ++j) dz[j] += p[j] - (1.0 - eps) * (j == y) - eps / v;
    } else {
      // -min(ratio A, clamp(ratio, lo, hi) A), differentiated as autograd would through
      // exp, mul, clamp and minimum; then the k3 KL term, clamped at 10.
      const double lo = 1.0 - static_cast<double>(o.clip_low);
      const double hi = 1.0 + static_cast<double>(o.clip_high);
      const double advantage = inputs.advantages[t];
      const double ratio = std::exp(logprob - inputs.old_logprob[t]);
      const double clamped = std::min(std::max(ratio, lo), hi);
      const double a = ratio * advantage, b = clamped * advantage;
      loss += -std::min(a, b);
      double da, db;
      MinimumBackward(a, b, &da, &db);
      const double dclamped = (ratio >= lo && ratio <= hi) ? 1.0 : 0.0;
      const double dratio = -(da * advantage + db * advantage * dclamped);
      double dlogprob = dratio * ratio;
      if (o.kl_coef > 0.0f) {
        // torch.clamp(k3, max=10): the gradient passes where k3 <= 10, the bound included. k3
        // is rounded as (exp(d) - 1) - d, the kernels' order, so that a token exactly at the
        // bound is at it for both.
        const double q = inputs.ref_logprob[t];
        const double k3 = (std::exp(q - logprob) - 1.0) - (q - logprob);
        loss += o.kl_coef * std::min(k3, 10.0);
        if (k3 <= 10.0) dlogprob += o.kl_coef * (1.0 - std::exp(q - logprob));
      }
      for (int64_t j = 0; j < v; ++j) dz[j] += dlogprob * ((j == y) - p[j]);
    }
    if (coef != 0.0) {
      loss += coef * entropy;
      for (int64_t j = 0; j < v; ++j) dz[j] += coef * -p[j] * (z[j] - expected_z);
    }
    const double w = inputs.token_weights.empty() ? 1.0 : inputs.token_weights[t];
    r.per_token_loss[t] = w * loss;
    r.loss_sum += w * loss;
    r.objective += reduction_scale * w * loss;

    // Back through the soft-cap (dz/dx = 1 - tanh^2) and the scale, into H, W and b.
    for (int64_t j = 0; j < v; ++j) {
      const double th = cap > 0.0 ? std::tanh(x[j] / cap) : 0.0;
      const double dx = reduction_scale * w * dz[j] * (1.0 - th * th);
      r.grad_bias[j] += dx;
      const double du = scale * dx;
      for (int64_t k = 0; k < d; ++k) {
        r.grad_hidden[t * d + k] += du * weight[j * d + k];
        r.grad_weight[j * d + k] += du * h[k];
      }
    }
  }
  return r;
}

TermInputs RandomTermInputs(const Problem& p, const std::vector<double>& hidden,
                            const std::vector<double>& weight, const std::vector<int32_t>& targets,
                            bool bias, bool weights, uint64_t seed, float kink_margin,
                            bool clamped_kl) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  TermInputs out;
  if (bias) {
    out.bias.resize(p.v);
    for (float& b : out.bias) b = 0.8f * unit(rng);
  }
  if (weights) {
    out.token_weights.resize(p.n);
    for (size_t t = 0; t < out.token_weights.size(); ++t) {
      out.token_weights[t] = t % 7 == 3 ? 0.0f : 0.75f + 1.25f * unit(rng);
    }
  }
  if (p.options.kind != LossKind::kPolicyGradient) return out;
  // log p does not depend on the old log p: a first pass with placeholders gives it.
  TermInputs probe = out;
  probe.old_logprob.assign(p.n, 0.0f);
  probe.advantages.assign(p.n, 0.0f);
  probe.ref_logprob.assign(p.n, 0.0f);
  const TermResult first = LossTermsReference(p, hidden, weight, targets, probe);
  const float lo = std::log(1.0f - p.options.clip_low), hi = std::log(1.0f + p.options.clip_high);
  out.old_logprob.resize(p.n);
  out.advantages.resize(p.n);
  for (int64_t t = 0; t < p.n; ++t) {
    float delta;  // log p - old log p = log ratio
    do {
      delta = 0.6f * unit(rng);
    } while (std::abs(delta - lo) < kink_margin || std::abs(delta - hi) < kink_margin);
    out.old_logprob[t] = static_cast<float>(first.per_token_logprob[t] - delta);
    out.advantages[t] = 2.0f * unit(rng);
  }
  if (p.options.kl_coef > 0.0f) {
    out.ref_logprob.resize(p.n);
    for (int64_t t = 0; t < p.n; ++t) {
      const float offset = !clamped_kl  ? 0.5f * unit(rng)
                           : t % 2 == 0 ? 4.5f + 1.5f * unit(rng)
                                        : 2.0f * unit(rng);
      out.ref_logprob[t] = static_cast<float>(first.per_token_logprob[t] + offset);
    }
  }
  return out;
}

}  // namespace losshead::kernels::testing
