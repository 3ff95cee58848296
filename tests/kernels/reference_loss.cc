#include "tests/kernels/reference_loss.h"

#include <algorithm>
#include <cmath>

namespace losshead::kernels::testing {

ReferenceResult ReferenceLoss(const Problem& problem, const std::vector<double>& hidden,
                              const std::vector<double>& weight,
                              const std::vector<int32_t>& targets) {
  const int64_t n = problem.n, d = problem.d, v = problem.v;
  const LossOptions& o = problem.options;
  const double cap = o.softcap, eps = o.label_smoothing, zl = o.z_loss;

  ReferenceResult out;
  out.per_token_loss.assign(n, 0.0);
  out.per_token_lse.assign(n, 0.0);
  out.per_token_logprob.assign(n, 0.0);
  out.per_token_entropy.assign(n, 0.0);
  out.per_token_argmax.assign(n, -1);
  out.per_token_top_gap.assign(n, INFINITY);
  out.grad_hidden.assign(n * d, 0.0);
  out.grad_weight.assign(v * d, 0.0);
  for (int64_t t = 0; t < n; ++t) out.token_count += targets[t] != o.ignore_index ? 1 : 0;

  double scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    scale = out.token_count == 0 ? 0.0 : o.grad_scale / static_cast<double>(out.token_count);
  }

  std::vector<double> x(v), z(v), dz_dx(v);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < v; ++j) {
      double dot = 0.0;
      for (int64_t k = 0; k < d; ++k) dot += hidden[t * d + k] * weight[j * d + k];
      x[j] = dot;
      if (cap > 0.0) {
        z[j] = cap * std::tanh(dot / cap);
        dz_dx[j] = 1.0 - std::tanh(dot / cap) * std::tanh(dot / cap);
      } else {
        z[j] = dot;
        dz_dx[j] = 1.0;
      }
    }
    const double zmax = *std::max_element(z.begin(), z.end());
    double sum = 0.0, mean_z = 0.0;
    for (int64_t j = 0; j < v; ++j) {
      sum += std::exp(z[j] - zmax);
      mean_z += z[j] / static_cast<double>(v);
    }
    const double lse = zmax + std::log(sum);
    out.per_token_lse[t] = lse;
    if (targets[t] == o.ignore_index) continue;

    const int64_t y = targets[t];
    // The distribution, straight from its definitions: log p_y, -sum p log p, first max.
    out.per_token_logprob[t] = z[y] - lse;
    double entropy = 0.0;
    int64_t first_max = 0;
    for (int64_t j = 0; j < v; ++j) {
      const double log_p = z[j] - lse;
      entropy -= std::exp(log_p) * log_p;
      if (z[j] > z[first_max]) first_max = j;
    }
    for (int64_t j = 0; j < v; ++j) {
      if (z[j] < zmax) out.per_token_top_gap[t] = std::min(out.per_token_top_gap[t], zmax - z[j]);
    }
    out.per_token_entropy[t] = entropy;
    out.per_token_argmax[t] = static_cast<int32_t>(first_max);
    out.correct_count += first_max == y ? 1 : 0;
    const double loss = (1.0 - eps) * (lse - z[y]) + eps * (lse - mean_z) + zl * lse * lse;
    out.per_token_loss[t] = loss;
    out.loss_sum += loss;
    for (int64_t j = 0; j < v; ++j) {
      const double p = std::exp(z[j] - lse);
      const double g_z = p * (1.0 + 2.0 * zl * lse) - (j == y ? 1.0 - eps : 0.0) - eps / v;
      const double g_x = scale * g_z * dz_dx[j];
      for (int64_t k = 0; k < d; ++k) {
        out.grad_hidden[t * d + k] += g_x * weight[j * d + k];
        out.grad_weight[j * d + k] += g_x * hidden[t * d + k];
      }
    }
  }
  return out;
}

}  // namespace losshead::kernels::testing
