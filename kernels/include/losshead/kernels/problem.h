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

// Loss options, applied per token t with target y and logits x_j = h_t . w_j:
//   z_j    = softcap > 0 ? softcap * tanh(x_j / softcap) : x_j
//   lse    = log sum_j exp(z_j)
//   loss_t = (1 - eps) (lse - z_y) + eps (lse - mean_j z_j) + z_loss * lse^2
// with eps = label_smoothing,
// and its gradient with respect to z_j:
//   g_j    = p_j (1 + 2 z_loss lse) - (1 - eps) [j == y] - eps / V,  p = softmax(z)
// chained through the soft-cap by (1 - (z_j / softcap)^2). A token whose target equals
// ignore_index contributes no loss, no gradient, and is not counted.
struct LossOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  float grad_scale = 1.0f;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;
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
  // the soft-cap; independent of label smoothing and z-loss, which change the loss, not p).
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
  void* workspace = nullptr;  // Backend::WorkspaceBytes(problem, budget) bytes
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

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_PROBLEM_H_
