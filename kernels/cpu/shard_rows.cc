#include "kernels/cpu/shard_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace losshead::kernels {

ShardRowStats ComputeShardRowStats(float* logits, int64_t rows, int64_t local_target,
                                   float softcap) {
  if (softcap > 0.0f) {
    const float inv_cap = 1.0f / softcap;
    for (int64_t j = 0; j < rows; ++j) logits[j] = softcap * std::tanh(logits[j] * inv_cap);
  }
  float max_z = -std::numeric_limits<float>::infinity();
  double sum_z = 0.0;
  for (int64_t j = 0; j < rows; ++j) {
    max_z = std::max(max_z, logits[j]);
    sum_z += logits[j];
  }
  double sum_exp = 0.0;
  for (int64_t j = 0; j < rows; ++j) sum_exp += std::exp(logits[j] - max_z);
  const bool owns_target = local_target >= 0 && local_target < rows;
  return ShardRowStats{{max_z, static_cast<float>(sum_exp), static_cast<float>(sum_z),
                        owns_target ? logits[local_target] : 0.0f}};
}

ShardTokenLoss CombineShardStats(const float* stats, int64_t stride, int shards, int64_t q,
                                 bool ignored, const LossOptions& options, int64_t v) {
  // Shard r's statistic s of token q (shard_problem.h's layout).
  auto at = [&](int r, int s) -> double { return stats[(r * kShardStats + s) * stride + q]; };
  double max_z = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < shards; ++r) max_z = std::max(max_z, at(r, 0));
  double sum_exp = 0.0, sum_z = 0.0, z_target = 0.0;
  for (int r = 0; r < shards; ++r) {
    sum_exp += at(r, 1) * std::exp(at(r, 0) - max_z);
    sum_z += at(r, 2);
    z_target += at(r, 3);
  }
  ShardTokenLoss result;
  result.lse = max_z + std::log(sum_exp);
  if (ignored) return result;
  const double eps = options.label_smoothing;
  const double lse = result.lse;
  result.loss = (1.0 - eps) * (lse - z_target) + eps * (lse - sum_z / static_cast<double>(v)) +
                options.z_loss * lse * lse;
  return result;
}

void ComputeShardRowGradient(float* z, int64_t rows, int64_t local_target, bool ignored, double lse,
                             const LossOptions& options, int64_t v, float grad_scale) {
  if (ignored) {
    std::memset(z, 0, static_cast<size_t>(rows) * sizeof(float));
    return;
  }
  const double eps = options.label_smoothing;
  // g_j = exp(z_j - lse) (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == y], scaled.
  const float shift = static_cast<float>(lse);
  const float p_scale = static_cast<float>((1.0 + 2.0 * options.z_loss * lse) * grad_scale);
  const float uniform = static_cast<float>(eps / static_cast<double>(v) * grad_scale);
  const float one_hot = static_cast<float>((1.0 - eps) * grad_scale);
  const bool owns_target = local_target >= 0 && local_target < rows;
  const float cap = options.softcap;
  for (int64_t j = 0; j < rows; ++j) {
    float g = std::exp(z[j] - shift) * p_scale - uniform;
    if (owns_target && j == local_target) g -= one_hot;
    if (cap > 0.0f) {
      const float ratio = z[j] / cap;
      g *= 1.0f - ratio * ratio;
    }
    z[j] = g;
  }
}

}  // namespace losshead::kernels
