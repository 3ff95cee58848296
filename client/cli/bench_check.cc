// `losshead bench`: the step checked before anything is timed.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cli/bench.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::cli::bench {
namespace {

// Tokens whose loss and dH rows the check recomputes on the host (each costs 2·V·D multiply-adds).
constexpr int64_t kCheckedTokens = 4;

// Compares the first tokens of `result` (a sum-reduced step with per-token losses) with the same
// tokens computed in float64 from W as the server holds it.
absl::Status CheckAgainstHost(client::Client& admin, const std::string& head, int64_t d, int64_t v,
                              const Batch& batch, const client::StepResult& result) {
  // In fp32, which holds every weight dtype exactly: a bf16 copy of an fp32 head would differ
  // from what the server multiplies by about as much as the check tolerates.
  auto w = admin.DownloadWeights(head, v1::DTYPE_FP32);
  if (!w.ok()) return w.status();
  if (w->data.size() != static_cast<size_t>(v) * d * sizeof(float)) {
    return absl::InternalError(
        absl::StrCat("downloaded W holds ", w->data.size(), " bytes, not V x D in fp32"));
  }
  const auto* weights = reinterpret_cast<const float*>(w->data.data());
  const auto* grad = reinterpret_cast<const uint16_t*>(result.grad_hidden.data());
  const int64_t checked = std::min<int64_t>(kCheckedTokens, result.token_count);
  if (static_cast<int64_t>(result.per_token_loss.size()) < checked ||
      result.grad_hidden.size() < static_cast<size_t>(checked * d) * sizeof(uint16_t)) {
    return absl::InternalError("check step returned no per-token losses or dH");
  }
  std::vector<double> logits(v);
  std::vector<double> dh(d);
  for (int64_t t = 0; t < checked; ++t) {
    const uint16_t* h = batch.hidden.data() + t * d;
    double max_logit = -INFINITY;
    for (int64_t j = 0; j < v; ++j) {
      const float* wj = weights + j * d;
      double dot = 0;
      for (int64_t k = 0; k < d; ++k) dot += double{wj[k]} * kernels::Bf16ToFloat(h[k]);
      logits[j] = dot;
      max_logit = std::max(max_logit, dot);
    }
    double z = 0;
    for (int64_t j = 0; j < v; ++j) z += std::exp(logits[j] - max_logit);
    const int32_t target = batch.targets[t];
    const double loss = max_logit + std::log(z) - logits[target];
    std::fill(dh.begin(), dh.end(), 0.0);
    double dh_scale = 0;
    for (int64_t j = 0; j < v; ++j) {
      const double g = std::exp(logits[j] - max_logit) / z - (j == target ? 1.0 : 0.0);
      const float* wj = weights + j * d;
      for (int64_t k = 0; k < d; ++k) dh[k] += g * wj[k];
    }
    for (double x : dh) dh_scale = std::max(dh_scale, std::fabs(x));
    // fp32 accumulation over D and V on the device, dH rounded to bf16 (2^-8 relative); an fp32
    // head's TF32 (high) or bf16 (medium) GEMM inputs err by no more than that.
    if (std::fabs(result.per_token_loss[t] - loss) > 1e-3 * std::max(1.0, loss)) {
      return absl::InternalError(absl::StrCat("token ", t, ": loss ", result.per_token_loss[t],
                                              ", float64 reference ", loss));
    }
    for (int64_t k = 0; k < d; ++k) {
      const double got = kernels::Bf16ToFloat(grad[t * d + k]);
      if (std::fabs(got - dh[k]) > 1e-2 * dh_scale + 1e-6) {
        return absl::InternalError(
            absl::StrCat("token ", t, ": dH[", k, "] ", got, ", float64 reference ", dh[k]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<double> CheckStep(client::Client& admin, const std::string& head, bool own_head,
                                 const Settings& settings, const Batch& batch) {
  const int64_t n = settings.tokens;
  client::Microbatch check =
      MakeMicrobatch(head, absl::StrCat("bench-check-", getpid()), 1, n, batch);
  check.options.set_reduction(v1::REDUCTION_SUM);
  check.options.set_return_per_token_loss(true);
  check.options.set_forward_only(true);
  absl::StatusOr<client::StepResult> result = admin.Step(check);
  if (!result.ok()) return result.status();
  if (!std::isfinite(result->loss) || result->token_count != n) {
    return absl::InternalError(
        absl::StrCat("loss ", result->loss, " over ", result->token_count, " tokens"));
  }
  if (own_head) {
    absl::Status status =
        CheckAgainstHost(admin, head, settings.hidden_size, settings.vocab_size, batch, *result);
    if (!status.ok()) return status;
  }
  return result->loss_sum / n;
}

}  // namespace losshead::cli::bench
