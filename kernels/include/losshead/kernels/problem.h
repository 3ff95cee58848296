// The fused linear + cross-entropy problem: what one call computes, independent of the backend.
#ifndef LOSSHEAD_KERNELS_PROBLEM_H_
#define LOSSHEAD_KERNELS_PROBLEM_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/grad_stash.h"

namespace losshead::kernels {

// Element type of H, W and dH. Softmax math and the dW accumulator are always fp32.
enum class DType { kBF16, kFP16, kFP32 };

size_t DTypeSize(DType dtype);
absl::string_view DTypeName(DType dtype);

// What an fp32 problem's GEMMs may round their inputs to, as torch.set_float32_matmul_precision
// ("highest", "high", "medium"): a permission, which a backend without the faster units ignores
// (the CPU backend computes every one as kHighest). The softmax, the loss, the GEMMs' sums and
// the dW accumulator are fp32 whichever it is. A 16-bit problem's products are exact in fp32
// already: it takes kHighest only.
enum class MatmulPrecision {
  kHighest,  // IEEE fp32 products (CUDA cores on a GPU)
  kHigh,     // TF32 tensor cores: inputs rounded to 10 mantissa bits
  kMedium,   // bf16 tensor cores allowed too: inputs rounded to 7 mantissa bits (cuBLAS on an
             // H100 runs it with its TF32 kernels: high's speed and rounding)
};

absl::string_view MatmulPrecisionName(MatmulPrecision precision);

enum class Reduction {
  kMean,  // loss = loss_sum / token_count, every gradient scaled by grad_scale / token_count
  kSum,   // loss = loss_sum, gradients scaled by grad_scale
  kNone,  // per-token losses; each token's gradient scaled by grad_scale (as kSum)
};

// What a token's loss is made of (LossOptions::kind).
enum class LossKind {
  kCrossEntropy,    // -log p_y, with label smoothing (the default)
  kPolicyGradient,  // the clipped policy-gradient objective of PPO / GRPO (below)
};

// Loss options, applied per token t with target y and logits x_j = h_t . w_j:
//   z_j    = softcap > 0 ? softcap * tanh(x_j / softcap) : x_j
//   lse    = log sum_j exp(z_j)
//   loss_t = (1 - eps) (lse - z_y) + eps (lse - mean_j z_j) + z_loss * lse^2
// with eps = label_smoothing,
// and its gradient with respect to z_j:
//   g_j    = p_j (1 + 2 z_loss lse) - (1 - eps) [j == y] - eps / V,  p = softmax(z)
// chained through the soft-cap by (1 - (z_j / softcap)^2). A token whose target equals
// ignore_index contributes no loss, no gradient, and is not counted.
//
// Model options and further terms, each off by default (and then costing nothing):
//
// Logit scale and output bias. The logits become
//   x_j = logit_scale * (h_t . w_j) + b_j
// before the soft-cap, b being Arguments::bias (V fp32; b = 0 without one). A sampling
// temperature T is logit_scale = 1 / T. The gradients of H and W carry the scale
// (dloss/d(h . w_j) = logit_scale dloss/dx_j); Arguments::grad_bias receives dloss/db_j =
// dloss/dx_j summed over the tokens.
//
// Per-token weights (Arguments::token_weights, N fp32): a counted token's loss and gradient are
// multiplied by its weight w_t, whichever kind the loss is and with every term below included.
// token_count stays the number of non-ignored tokens, and kMean still divides by it: loss =
// sum_t w_t loss_t / token_count, the masked token mean RL trainers take (a weight of 0 counts a
// token but adds nothing). A weighted mean sum_t w_t loss_t / sum_t w_t is kSum with grad_scale
// = 1 / sum_t w_t, the caller's sum. per_token_loss and loss_sum hold the weighted losses.
//
// Entropy term (entropy_coef, any finite value; negative rewards entropy, as an RL bonus does):
//   loss_t += entropy_coef * H_t,  H_t = lse - sum_j p_j z_j   (the entropy of p = softmax(z))
//   dH_t/dz_j = -p_j (z_j - sum_k p_k z_k)
// chained through the soft-cap and the scale as every other term.
//
// Policy gradient (kind = kPolicyGradient). With log p_t = z_y - lse (z at the scale, bias and
// soft-cap above), Arguments::old_logprob o_t and Arguments::advantages A_t (N fp32 each):
//   r_t    = exp(log p_t - o_t)
//   loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
//            + kl_coef * min(k3_t, 10)                                  (low-variance KL)
//            + z_loss * lse^2 + entropy_coef * H_t
//   k3_t   = exp(q_t - log p_t) - (q_t - log p_t) - 1  (the k3 estimator, >= 0)
// q_t being Arguments::ref_logprob (needed exactly when kl_coef > 0); the clamp at 10
// (loss_math.h's kKlClamp) is torch.clamp(k3, max=10), verl's low_var_kl. The loss depends on z
// through log p_t (and lse, H_t for their terms), so with c_t = dloss_t/dlog p_t:
//   g_j    = c_t ([j == y] - p_j) + 2 z_loss lse p_j + entropy_coef dH_t/dz_j
//   c_t    = -r_t A_t m_t + kl_coef (1 - exp(q_t - log p_t)) [k3_t <= 10]
// where m_t is how much of the min's gradient reaches r_t, as PyTorch's autograd takes it for
// torch.min(r A, torch.clamp(r, lo, hi) A): 1 where r A < clip(r) A; the clamp's gradient
// [lo <= r <= hi] (bounds included) where r A > clip(r) A; and at a tie half of each, so 1 inside
// [lo, hi] (where clip(r) = r) and 1/2 outside it; the KL clamp likewise passes the gradient at
// its bound (k3_t = 10) and stops it above. Label smoothing is cross-entropy's and is
// refused with kPolicyGradient; ignore_index, the reduction, grad_scale, weights, z-loss, the
// entropy term, the soft-cap, the scale and the bias apply to both kinds.
struct LossOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  float grad_scale = 1.0f;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;
  // Finite and > 0; 1 is off.
  float logit_scale = 1.0f;
  // Finite, any sign; 0 is off.
  float entropy_coef = 0.0f;
  LossKind kind = LossKind::kCrossEntropy;
  // kPolicyGradient only: the clip range [1 - clip_low, 1 + clip_high], clip_low in [0, 1],
  // clip_high finite and >= 0; the KL term's coefficient, finite and >= 0 (0 with
  // kCrossEntropy).
  float clip_low = 0.2f;
  float clip_high = 0.2f;
  float kl_coef = 0.0f;
};

// A soft-cap is 0 (off) or a normal fp32 number: the kernels multiply by 1 / softcap, which a
// subnormal one overflows to Inf (and 0 * Inf to NaN in every gradient).
inline constexpr absl::string_view kSoftcapRange = "0 (off) or finite and >= 1.17549435e-38";
inline bool ValidSoftcap(float softcap) {
  return softcap == 0.0f ||
         (softcap >= std::numeric_limits<float>::min() && std::isfinite(softcap));
}

// Shapes and types (and the GEMMs' precision): H is N x D, W is V x D (both row-major, `dtype`),
// targets are N int32.
struct Problem {
  int64_t n = 0;
  int64_t d = 0;
  int64_t v = 0;
  DType dtype = DType::kBF16;
  LossOptions options;
  MatmulPrecision precision = MatmulPrecision::kHighest;
};

// Checks shapes and options without touching memory: INVALID_ARGUMENT names the offending field.
// Targets are not checked here (they live in device memory); callers validate them beforehand.
absl::Status ValidateProblem(const Problem& problem);

// Pointers for one call. Which memory they live in (host or device) is the backend's: see
// Backend::Allocate. Optional outputs are skipped when null.
struct Arguments {
  const void* hidden = nullptr;      // N x D, problem.dtype
  const void* weight = nullptr;      // V x D, problem.dtype
  const int32_t* targets = nullptr;  // N, in [0, V) or ignore_index
  void* grad_hidden = nullptr;       // N x D, problem.dtype, overwritten; optional
  float* grad_weight = nullptr;      // V x D fp32, accumulated into (+=); optional
  // Deferred dW (grad_stash.h): when its data is set, G and H go to the stash's rows
  // [tokens, tokens + N) instead of into grad_weight, which must then be null.
  GradStash grad_stash;
  // Outputs: [0] = sum of per-token losses over non-ignored tokens, overwritten.
  float* loss_sum = nullptr;
  // [0] = number of non-ignored tokens, overwritten.
  int64_t* token_count = nullptr;
  float* per_token_loss = nullptr;  // N, 0 for ignored tokens; optional
  float* per_token_lse = nullptr;   // N, lse for every token (ignored ones too); optional
  // What the model predicts: per token, the distribution p = softmax(z) the loss uses (z after
  // the logit scale, bias and soft-cap; independent of label smoothing, z-loss, the entropy term,
  // the weights and the loss's kind, which change the loss, not p).
  // Each is optional and independent of the others: a null one is neither computed nor written,
  // and a call that asks for none does no work beyond the loss's. Asking for any changes no
  // other output by a single bit. An ignored token gets the value named and is not counted.
  //   log p_y = z_y - lse, in (-Inf, 0]; 0 for an ignored token.
  float* per_token_logprob = nullptr;
  //   -sum_j p_j log p_j = lse - sum_j p_j z_j, in [0, log V] (up to rounding); 0 for an
  //   ignored token.
  float* per_token_entropy = nullptr;
  //   The lowest j with z_j = max_k z_k, in [0, V) (ties in z after the soft-cap, which can
  //   merge logits that differ before it); -1 for an ignored token.
  int32_t* per_token_argmax = nullptr;
  // [0] = number of non-ignored tokens whose argmax (as above) is their target, overwritten;
  // token accuracy is correct_count / token_count. Needs no per_token_argmax.
  int64_t* correct_count = nullptr;
  // Inputs and outputs of the model options and terms above LossOptions, each optional and
  // read only when given; what they mean is there. A call whose values are not all finite where
  // they are read is refused before anything is written (INVALID_ARGUMENT naming the field and
  // the class or token): every bias entry, and the per-token inputs of counted tokens (an
  // ignored token's are not read, so not checked). The CPU backend checks them on the host; the
  // CUDA backend reads them on the device only and leaves the check to its caller (as targets).
  const float* bias = nullptr;           // V fp32
  float* grad_bias = nullptr;            // V fp32, accumulated into (+=); only with bias
  const float* token_weights = nullptr;  // N fp32
  // kPolicyGradient's inputs: old_logprob and advantages required, ref_logprob exactly when
  // kl_coef > 0; none of them with kCrossEntropy.
  const float* old_logprob = nullptr;  // N fp32
  const float* advantages = nullptr;   // N fp32
  const float* ref_logprob = nullptr;  // N fp32
  void* workspace = nullptr;           // Backend::WorkspaceBytes(problem, budget) bytes
  size_t workspace_bytes = 0;
  // Top-k of p (a distribution output as the four above): per token, the top_k ids with the
  // largest z, in decreasing z and, among equal z, increasing id (so [0] is per_token_argmax), and
  // their log p_j = z_j - lse. N x top_k each, row-major; either may be null. An ignored token
  // gets ids -1 and log-probs 0. top_k is in [1, min(kMaxTopK, V)] when either is given, and
  // ignored (any value) when both are null.
  int32_t top_k = 0;
  int32_t* top_k_ids = nullptr;
  float* top_k_logprobs = nullptr;
};

// The largest top_k a call may ask for: each token's candidates are kept in registers (CUDA) or a
// short sorted list (CPU).
inline constexpr int32_t kMaxTopK = 16;

// Whether `args` (Arguments or ShardArguments) asks for any distribution output: four pointer
// tests, so a path that does not compute them checks it on every call for nothing.
template <typename Args>
bool AsksDistributionOutputs(const Args& args) {
  return args.per_token_logprob != nullptr || args.per_token_entropy != nullptr ||
         args.per_token_argmax != nullptr || args.correct_count != nullptr ||
         args.top_k_ids != nullptr || args.top_k_logprobs != nullptr;
}

// Whether `args` asks for the top-k outputs (top_k_ids or top_k_logprobs).
template <typename Args>
bool AsksTopK(const Args& args) {
  return args.top_k_ids != nullptr || args.top_k_logprobs != nullptr;
}

// INVALID_ARGUMENT when `args` asks for the top-k with top_k outside [1, min(kMaxTopK, v)].
template <typename Args>
absl::Status ValidateTopK(const Args& args, int64_t v) {
  if (!AsksTopK(args)) return absl::OkStatus();
  if (args.top_k < 1 || args.top_k > kMaxTopK || args.top_k > v) {
    return absl::InvalidArgumentError("top_k must be in [1, " + std::to_string(kMaxTopK) +
                                      "] and at most v (" + std::to_string(v) +
                                      ") when top_k_ids or top_k_logprobs is given, got " +
                                      std::to_string(args.top_k));
  }
  return absl::OkStatus();
}

// The distribution outputs (per_token_logprob, per_token_entropy, per_token_argmax,
// correct_count, top_k_ids, top_k_logprobs) that `args` asks for, by field name, comma-separated;
// empty when none. For a backend or a path that does not compute them yet to refuse them by name
// (UNIMPLEMENTED).
template <typename Args>
std::string RequestedDistributionOutputs(const Args& args) {
  std::string names;
  auto add = [&names](bool asked, absl::string_view name) {
    if (!asked) return;
    if (!names.empty()) names += ", ";
    names.append(name.data(), name.size());
  };
  add(args.per_token_logprob != nullptr, "per_token_logprob");
  add(args.per_token_entropy != nullptr, "per_token_entropy");
  add(args.per_token_argmax != nullptr, "per_token_argmax");
  add(args.correct_count != nullptr, "correct_count");
  add(args.top_k_ids != nullptr, "top_k_ids");
  add(args.top_k_logprobs != nullptr, "top_k_logprobs");
  return names;
}

// The model options and terms of LossOptions that `options` turns on (logit_scale,
// entropy_coef, kind=policy_gradient), by field name, comma-separated; empty when none. For a
// backend or a path that does not compute them yet to refuse them by name (UNIMPLEMENTED).
std::string RequestedLossTerms(const LossOptions& options);

// Whether `args` (Arguments or ShardArguments) gives any input or output of those terms: six
// pointer tests.
template <typename Args>
bool AsksLossInputs(const Args& args) {
  return args.bias != nullptr || args.grad_bias != nullptr || args.token_weights != nullptr ||
         args.old_logprob != nullptr || args.advantages != nullptr || args.ref_logprob != nullptr;
}

// The inputs and outputs of those terms that `args` gives, by field name, comma-separated;
// empty when none. As RequestedDistributionOutputs, for a refusal by name.
template <typename Args>
std::string RequestedLossInputs(const Args& args) {
  std::string names;
  auto add = [&names](bool asked, absl::string_view name) {
    if (!asked) return;
    if (!names.empty()) names += ", ";
    names.append(name.data(), name.size());
  };
  add(args.bias != nullptr, "bias");
  add(args.grad_bias != nullptr, "grad_bias");
  add(args.token_weights != nullptr, "token_weights");
  add(args.old_logprob != nullptr, "old_logprob");
  add(args.advantages != nullptr, "advantages");
  add(args.ref_logprob != nullptr, "ref_logprob");
  return names;
}

// Checks the pointers of the terms above against the problem's options (INVALID_ARGUMENT naming
// the field): grad_bias only with bias; old_logprob and advantages with kPolicyGradient and only
// then; ref_logprob exactly when kl_coef > 0. Values are the backend's to check (Arguments).
absl::Status ValidateLossInputs(const Problem& problem, const Arguments& args);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_PROBLEM_H_
