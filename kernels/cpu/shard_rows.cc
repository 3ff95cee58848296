#include "kernels/cpu/shard_rows.h"

#include <algorithm>
#include <bit>
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

void ComputeShardOutputStats(const float* z, int64_t rows, int64_t row_begin, int top_k, float* out,
                             int64_t stride) {
  // The same sums, in the same order, as the one-device row's (row_math.h).
  const cpu::RowDistributionSums dist = cpu::SumRowDistribution(z, rows);
  out[0] = static_cast<float>(dist.sum_shifted_z);
  out[stride] = std::bit_cast<float>(static_cast<int32_t>(row_begin + dist.argmax));
  if (top_k == 0) return;
  const cpu::RowTopK top = cpu::TopKRow(z, rows, top_k, row_begin);
  for (int i = 0; i < top_k; ++i) {
    const bool filled = i < top.count;
    out[(kShardOutputStats + i) * stride] =
        filled ? top.z[i] : -std::numeric_limits<float>::infinity();
    out[(kShardOutputStats + top_k + i) * stride] =
        std::bit_cast<float>(filled ? static_cast<int32_t>(top.id[i]) : int32_t{-1});
  }
}

ShardTokenOutputs CombineShardOutputStats(const float* stats, const float* output_stats,
                                          int64_t stride, int shards, int64_t q, double lse,
                                          int top_k, int32_t* top_ids, float* top_logprobs) {
  auto at = [&](int r, int s) -> double { return stats[(r * kShardStats + s) * stride + q]; };
  const int per_shard = kShardOutputStats + 2 * top_k;
  auto out_at = [&](int r, int s) -> float {
    return output_stats[(static_cast<int64_t>(r) * per_shard + s) * stride + q];
  };
  auto id_at = [&](int r, int s) -> int32_t { return std::bit_cast<int32_t>(out_at(r, s)); };
  // Max and sum_exp as CombineShardStats forms them; s and the argmax beside them.
  double max_z = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < shards; ++r) max_z = std::max(max_z, at(r, 0));
  double sum_exp = 0.0, sum_shifted_z = 0.0, z_target = 0.0;
  float best_z = static_cast<float>(at(0, 0));
  int32_t best_id = id_at(0, 1);
  for (int r = 0; r < shards; ++r) {
    sum_exp += loss::Rescaled(at(r, 1), at(r, 0), max_z);
    sum_shifted_z +=
        loss::RescaledShiftedZ(static_cast<double>(out_at(r, 0)), at(r, 1), at(r, 0), max_z);
    z_target += at(r, 3);
    const float m = static_cast<float>(at(r, 0));
    if (loss::ArgmaxBeats(m, id_at(r, 1), best_z, best_id)) {
      best_z = m;
      best_id = id_at(r, 1);
    }
  }
  ShardTokenOutputs result;
  result.logprob = loss::TargetLogProb(lse, z_target);
  result.entropy = loss::Entropy(sum_exp, sum_shifted_z);
  result.argmax = best_id;
  if (top_k == 0 || (top_ids == nullptr && top_logprobs == nullptr)) return result;
  cpu::RowTopK top;
  top.k = top_k;
  for (int r = 0; r < shards; ++r) {
    for (int i = 0; i < top_k; ++i) {
      const int32_t id = id_at(r, kShardOutputStats + top_k + i);
      if (id >= 0) top.Offer(out_at(r, kShardOutputStats + i), id);
    }
  }
  for (int i = 0; i < top_k; ++i) {
    const bool filled = i < top.count;
    if (top_ids != nullptr) top_ids[i] = filled ? static_cast<int32_t>(top.id[i]) : -1;
    if (top_logprobs != nullptr) {
      top_logprobs[i] =
          filled ? static_cast<float>(loss::TargetLogProb(lse, static_cast<double>(top.z[i])))
                 : 0.0f;
    }
  }
  return result;
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
  result.z_target = z_target;
  result.sum_z = sum_z;
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

namespace {

// A counted token's unweighted loss and unscaled gradient factors (for e_j = exp(z_j - lse)) from
// the combined statistics: the terms' part of a row (loss_math.h's TermsLossOf), as
// ComputeRowLossWithTerms (row_terms.cc) forms it on one device.
loss::BasicTermsLoss<double> TermsOf(const LossOptions& options, const ShardTokenLoss& token,
                                     int64_t v, double entropy, const TokenTerms& inputs) {
  const loss::Options o = loss::OptionsOf(options);
  const double vocab = static_cast<double>(v);
  return loss::TermsLossOf(
      o, loss::TermOptionsOf(options), token.lse, token.z_target, vocab, entropy, inputs,
      [&] { return loss::TokenLoss(o, token.lse, token.z_target, token.sum_z, vocab); });
}

}  // namespace

double ShardTermsLoss(const LossOptions& options, const ShardTokenLoss& token, int64_t v,
                      double entropy, const TokenTerms& inputs) {
  return inputs.weight * TermsOf(options, token, v, entropy, inputs).loss;
}

void ComputeShardRowGradientWithTerms(float* z, int64_t rows, int64_t local_target, bool ignored,
                                      const ShardTokenLoss& token, const LossOptions& options,
                                      int64_t v, double entropy, const TokenTerms& inputs,
                                      float grad_scale) {
  if (ignored) {
    std::memset(z, 0, static_cast<size_t>(rows) * sizeof(float));
    return;
  }
  const loss::BasicTermsLoss<double> t = TermsOf(options, token, v, entropy, inputs);
  // The weight and the logit scale join the reduction's scale, folded into the fp32 factors once.
  const double scale =
      static_cast<double>(grad_scale) * inputs.weight * static_cast<double>(options.logit_scale);
  const loss::GradFactors f = loss::FoldedGradFactors(t.factors, /*p_divisor=*/1.0, scale);
  const loss::Softcap cap = loss::Softcap::Of(options.softcap);
  const int64_t target = local_target >= 0 && local_target < rows ? local_target : -1;
  const float lse = static_cast<float>(token.lse);
  if (options.entropy_coef != 0.0f) {
    // Against lse (e_j = p_j): z_j - sum_k p_k z_k = (z_j - lse) + entropy.
    const loss::EntropyGrad h{
        static_cast<float>(-static_cast<double>(options.entropy_coef) * scale),
        static_cast<float>(-entropy)};
    cpu::WriteRowGradientWithEntropy(z, rows, target, lse, f, h, cap);
  } else {
    cpu::WriteRowGradient<cpu::CapRatio::kDivided>(z, rows, target, lse, f, cap);
  }
}

}  // namespace losshead::kernels
