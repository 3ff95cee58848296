#include "tests/service/reference.h"

#include <algorithm>
#include <cmath>

namespace losshead::testing {

RefResult Reference(const std::vector<float>& weight, const std::vector<float>& hidden,
                    const std::vector<int64_t>& targets, int64_t n, int64_t d, int64_t v,
                    const RefOptions& o) {
  RefResult r;
  r.per_token_loss.assign(n, 0.0);
  r.grad_hidden.assign(n * d, 0.0);
  r.grad_weight.assign(v * d, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    if (targets[t] != o.ignore_index) ++r.token_count;
  }
  // The scale every token's gradient gets: MEAN divides by the micro-batch's own token count.
  const double scale = o.reduction == v1::REDUCTION_MEAN
                           ? (r.token_count > 0 ? o.grad_scale / r.token_count : 0.0)
                           : o.grad_scale;
  const double eps = o.label_smoothing;
  std::vector<double> z(v), dz(v), g(v);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t y = targets[t];
    if (y == o.ignore_index) continue;
    const float* h = hidden.data() + t * d;
    double zmax = -INFINITY, zsum = 0;
    for (int64_t j = 0; j < v; ++j) {
      double x = 0;
      for (int64_t k = 0; k < d; ++k) x += static_cast<double>(weight[j * d + k]) * h[k];
      if (o.softcap > 0) {
        z[j] = o.softcap * std::tanh(x / o.softcap);
        dz[j] = 1.0 - (z[j] / o.softcap) * (z[j] / o.softcap);
      } else {
        z[j] = x;
        dz[j] = 1.0;
      }
      zmax = std::max(zmax, z[j]);
      zsum += z[j];
    }
    double se = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(z[j] - zmax);
    const double lse = zmax + std::log(se);
    const double loss = (1 - eps) * (lse - z[y]) + eps * (lse - zsum / v) + o.z_loss * lse * lse;
    r.per_token_loss[t] = loss;
    r.loss_sum += loss;
    for (int64_t j = 0; j < v; ++j) {
      const double p = std::exp(z[j] - lse);
      g[j] = (p * (1 + 2 * o.z_loss * lse) - (j == y ? 1 - eps : 0.0) - eps / v) * dz[j] * scale;
    }
    for (int64_t j = 0; j < v; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        r.grad_hidden[t * d + k] += g[j] * weight[j * d + k];
        r.grad_weight[j * d + k] += g[j] * h[k];
      }
    }
  }
  r.loss = o.reduction == v1::REDUCTION_MEAN
               ? (r.token_count > 0 ? r.loss_sum / r.token_count : 0.0)
               : r.loss_sum;
  return r;
}

}  // namespace losshead::testing
