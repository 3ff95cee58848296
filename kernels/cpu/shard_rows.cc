#include "kernels/cpu/shard_rows.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/common/loss_math.h"
#include "kernels/cpu/row_math.h"

namespace losshead::kernels {

ShardRowStats ComputeShardRowStats(float* logits, int64_t rows, int64_t local_target,
                                   float softcap) {
  cpu::SoftcapRow(logits, rows, loss::Softcap::Of(softcap));
  const cpu::RowSums sums = cpu::SumRow(logits, rows);
  const bool owns_target = local_target >= 0 && local_target < rows;
  return ShardRowStats{{sums.max_z, static_cast<float>(sums.sum_exp),
                        static_cast<float>(sums.sum_z), owns_target ? logits[local_target] : 0.0f}};
}

ShardTokenLoss CombineShardStats(const float* stats, int64_t stride, int shards, int64_t q,
                                 bool ignored, const LossOptions& options, int64_t v) {
  // Shard r's statistic s of token q (shard_problem.h's layout).
  auto at = [&](int r, int s) -> double { return stats[(r * kShardStats + s) * stride + q]; };
  double max_z = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < shards; ++r) max_z = std::max(max_z, at(r, 0));
  double sum_exp = 0.0, sum_z = 0.0, z_target = 0.0;
  for (int r = 0; r < shards; ++r) {
    sum_exp += loss::Rescaled(at(r, 1), at(r, 0), max_z);
    sum_z += at(r, 2);
    z_target += at(r, 3);
  }
  ShardTokenLoss result;
  result.lse = loss::Lse(max_z, sum_exp);
  if (ignored) return result;
  result.loss = loss::TokenLoss(loss::OptionsOf(options), result.lse, z_target, sum_z,
                                static_cast<double>(v));
  return result;
}

void ComputeShardRowGradient(float* z, int64_t rows, int64_t local_target, bool ignored, double lse,
                             const LossOptions& options, int64_t v, float grad_scale) {
  if (ignored) {
    std::memset(z, 0, static_cast<size_t>(rows) * sizeof(float));
    return;
  }
  const loss::Options o = loss::OptionsOf(options);
  // Unscaled factors from the whole vocabulary's lse and v; the scale is folded into all three.
  const loss::GradFactors f = loss::FoldedGradFactors(
      loss::GradFactorsOf(o, lse, static_cast<double>(v)), /*p_divisor=*/1.0, grad_scale);
  const bool owns_target = local_target >= 0 && local_target < rows;
  cpu::WriteRowGradient<cpu::CapRatio::kDivided>(z, rows, owns_target ? local_target : -1,
                                                 static_cast<float>(lse), f,
                                                 loss::Softcap::Of(o.softcap));
}

}  // namespace losshead::kernels
