#include "kernels/cpu/row_loss.h"

#include <cstring>

#include "kernels/common/loss_math.h"
#include "kernels/cpu/row_math.h"

namespace losshead::kernels {

void WriteRowTopK(const float* z, int64_t v, double lse, const RowDistribution& distribution) {
  if (distribution.top_k <= 0) return;
  const cpu::RowTopK top = cpu::TopKRow(z, v, distribution.top_k, 0);
  for (int i = 0; i < top.count; ++i) {
    if (distribution.top_k_ids != nullptr) {
      distribution.top_k_ids[i] = static_cast<int32_t>(top.id[i]);
    }
    if (distribution.top_k_logprobs != nullptr) {
      distribution.top_k_logprobs[i] =
          static_cast<float>(loss::TargetLogProb(lse, static_cast<double>(top.z[i])));
    }
  }
}

RowLoss ComputeRowLoss(float* logits, int64_t v, int32_t target, bool ignored,
                       const LossOptions& options, float grad_scale, bool write_gradient,
                       RowDistribution* distribution) {
  const loss::Options o = loss::OptionsOf(options);
  const loss::Softcap cap = loss::Softcap::Of(o.softcap);
  // Soft-cap in place: from here on the row holds z, which is also what the cap's derivative needs.
  cpu::SoftcapRow(logits, v, cap);
  // The distribution's extra sums only where asked: one branch per row, none per element.
  const bool distribute = distribution != nullptr && !ignored;
  cpu::RowDistributionSums dist_sums;
  if (distribute) dist_sums = cpu::SumRowDistribution(logits, v);
  const cpu::RowSums sums = distribute ? dist_sums.sums : cpu::SumRow(logits, v);
  const double lse = loss::Lse(static_cast<double>(sums.max_z), sums.sum_exp);
  if (distribute) {
    distribution->logprob = loss::TargetLogProb(lse, static_cast<double>(logits[target]));
    distribution->entropy = loss::Entropy(sums.sum_exp, dist_sums.sum_shifted_z);
    distribution->argmax = static_cast<int32_t>(dist_sums.argmax);
    WriteRowTopK(logits, v, lse, *distribution);
  }

  RowLoss result;
  result.lse = lse;
  if (ignored) {
    if (write_gradient) std::memset(logits, 0, static_cast<size_t>(v) * sizeof(float));
    return result;
  }
  const double vocab = static_cast<double>(v);
  result.loss = loss::TokenLoss(o, lse, static_cast<double>(logits[target]), sums.sum_z, vocab);
  if (!write_gradient) return result;

  // p_j = exp(z_j - max) / sum_exp: 1 / sum_exp and the scale are folded into p_scale.
  const loss::GradFactors f =
      loss::FoldedGradFactors(loss::GradFactorsOf(o, lse, vocab), sums.sum_exp, grad_scale);
  cpu::WriteRowGradient<cpu::CapRatio::kTimesInverse>(logits, v, target, sums.max_z, f, cap);
  return result;
}

}  // namespace losshead::kernels
