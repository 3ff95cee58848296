#include "kernels/cpu/row_loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace losshead::kernels {

RowLoss ComputeRowLoss(float* logits, int64_t v, int32_t target, bool ignored,
                       const LossOptions& options, float grad_scale, bool write_gradient) {
  const float cap = options.softcap;
  // Soft-cap in place: from here on the row holds z, which is also what the cap's derivative needs.
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int64_t j = 0; j < v; ++j) logits[j] = cap * std::tanh(logits[j] * inv_cap);
  }
  float max_z = -std::numeric_limits<float>::infinity();
  double sum_z = 0.0;
  for (int64_t j = 0; j < v; ++j) {
    max_z = std::max(max_z, logits[j]);
    sum_z += logits[j];
  }
  double sum_exp = 0.0;
  for (int64_t j = 0; j < v; ++j) sum_exp += std::exp(logits[j] - max_z);
  const double lse = static_cast<double>(max_z) + std::log(sum_exp);

  RowLoss result;
  result.lse = lse;
  if (ignored) {
    if (write_gradient) std::memset(logits, 0, static_cast<size_t>(v) * sizeof(float));
    return result;
  }
  const double eps = options.label_smoothing;
  const double z_loss = options.z_loss;
  const double z_target = logits[target];
  result.loss = (1.0 - eps) * (lse - z_target) + eps * (lse - sum_z / static_cast<double>(v)) +
                z_loss * lse * lse;
  if (!write_gradient) return result;

  // g_j = p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == y], with p_j = exp(z_j - max) / sum.
  const float p_scale = static_cast<float>((1.0 + 2.0 * z_loss * lse) / sum_exp * grad_scale);
  const float uniform = static_cast<float>(eps / static_cast<double>(v) * grad_scale);
  const float one_hot = static_cast<float>((1.0 - eps) * grad_scale);
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int64_t j = 0; j < v; ++j) {
      const float z = logits[j];
      const float ratio = z * inv_cap;
      float g = std::exp(z - max_z) * p_scale - uniform;
      if (j == target) g -= one_hot;
      logits[j] = g * (1.0f - ratio * ratio);
    }
  } else {
    for (int64_t j = 0; j < v; ++j) logits[j] = std::exp(logits[j] - max_z) * p_scale - uniform;
    logits[target] -= one_hot;
  }
  return result;
}

}  // namespace losshead::kernels
