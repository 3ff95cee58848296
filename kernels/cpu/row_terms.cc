#include "kernels/cpu/row_terms.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/common/loss_math.h"
#include "kernels/cpu/row_math.h"

namespace losshead::kernels {
namespace {

absl::Status NotFinite(absl::string_view field, int64_t index, float value) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, "[", index, "] must be finite, got ", value));
}

}  // namespace

bool RowTermsOn(const LossOptions& options, const Arguments& args) {
  return loss::AnyTerm(loss::TermOptionsOf(options)) || args.bias != nullptr ||
         args.token_weights != nullptr;
}

absl::Status CheckTermInputs(const Problem& problem, const Arguments& args) {
  if (args.bias != nullptr) {
    for (int64_t j = 0; j < problem.v; ++j) {
      if (!std::isfinite(args.bias[j])) return NotFinite("bias", j, args.bias[j]);
    }
  }
  const struct {
    absl::string_view name;
    const float* values;
  } per_token[] = {{"token_weights", args.token_weights},
                   {"old_logprob", args.old_logprob},
                   {"advantages", args.advantages},
                   {"ref_logprob", args.ref_logprob}};
  for (const auto& input : per_token) {
    if (input.values == nullptr) continue;
    for (int64_t t = 0; t < problem.n; ++t) {
      if (args.targets[t] == problem.options.ignore_index) continue;
      if (!std::isfinite(input.values[t])) return NotFinite(input.name, t, input.values[t]);
    }
  }
  return absl::OkStatus();
}

TokenTerms TokenTermsOf(const Arguments& args, int64_t t) {
  TokenTerms token;
  if (args.token_weights != nullptr) token.weight = args.token_weights[t];
  if (args.old_logprob != nullptr) token.old_logprob = args.old_logprob[t];
  if (args.advantages != nullptr) token.advantage = args.advantages[t];
  if (args.ref_logprob != nullptr) token.ref_logprob = args.ref_logprob[t];
  return token;
}

RowLoss ComputeRowLossWithTerms(float* logits, int64_t v, int32_t target, bool ignored,
                                const LossOptions& options, const float* bias,
                                const TokenTerms& token, float grad_scale, bool write_gradient,
                                RowDistribution* distribution) {
  const loss::Options o = loss::OptionsOf(options);
  const loss::TermOptions terms = loss::TermOptionsOf(options);
  const loss::Softcap cap = loss::Softcap::Of(o.softcap);
  cpu::ScaleBiasRow(logits, v, terms.logit_scale, bias);
  cpu::SoftcapRow(logits, v, cap);
  // The entropy's statistic where the term or the output needs it, as ComputeRowLoss sums it.
  const bool entropy_term = terms.entropy_coef != 0.0f && !ignored;
  const bool distribute = distribution != nullptr && !ignored;
  const bool entropy_sums = entropy_term || distribute;
  cpu::RowDistributionSums dist_sums;
  if (entropy_sums) dist_sums = cpu::SumRowDistribution(logits, v);
  const cpu::RowSums sums = entropy_sums ? dist_sums.sums : cpu::SumRow(logits, v);
  const double lse = loss::Lse(static_cast<double>(sums.max_z), sums.sum_exp);
  const double entropy = entropy_sums ? loss::Entropy(sums.sum_exp, dist_sums.sum_shifted_z) : 0.0;
  if (distribute) {
    distribution->logprob = loss::TargetLogProb(lse, static_cast<double>(logits[target]));
    distribution->entropy = entropy;
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
  const double z_target = static_cast<double>(logits[target]);
  const loss::BasicTermsLoss<double> t =
      loss::TermsLossOf(o, terms, lse, z_target, vocab, entropy, token,
                        [&] { return loss::TokenLoss(o, lse, z_target, sums.sum_z, vocab); });
  const double loss = t.loss;
  const loss::BasicGradFactors<double>& factors = t.factors;
  result.loss = token.weight * loss;
  if (!write_gradient) return result;

  // The token's weight and the logit scale (the chain rule's last link, into u_j = h . w_j) join
  // the reduction's scale, all folded into the fp32 factors once.
  const double scale =
      static_cast<double>(grad_scale) * token.weight * static_cast<double>(terms.logit_scale);
  const loss::GradFactors f = loss::FoldedGradFactors(factors, sums.sum_exp, scale);
  if (entropy_term) {
    const loss::EntropyGrad h = loss::FoldedEntropyGrad(
        static_cast<double>(terms.entropy_coef), sums.sum_exp, dist_sums.sum_shifted_z, scale);
    cpu::WriteRowGradientWithEntropy(logits, v, target, sums.max_z, f, h, cap);
  } else {
    cpu::WriteRowGradient<cpu::CapRatio::kTimesInverse>(logits, v, target, sums.max_z, f, cap);
  }
  return result;
}

}  // namespace losshead::kernels
