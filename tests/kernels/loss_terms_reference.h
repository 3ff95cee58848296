// A naive float64 evaluation of the model options and loss terms beyond the plain loss (logit
// scale, bias, per-token weights, the entropy term, the policy-gradient loss: problem.h), written
// from the formulas in problem.h's comment and sharing no code with the backends. The oracle of
// cpu_loss_terms_test.cc; its gradients are themselves checked there against central differences
// of its loss. O(N V D): small shapes only.
#ifndef LOSSHEAD_TESTS_KERNELS_LOSS_TERMS_REFERENCE_H_
#define LOSSHEAD_TESTS_KERNELS_LOSS_TERMS_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "losshead/kernels/problem.h"
#include "tests/kernels/backend_runner.h"

namespace losshead::kernels::testing {

// The terms' inputs as a call gives them (Arguments), each empty when not given: bias V, the
// others N.
struct TermInputs {
  std::vector<float> bias;
  std::vector<float> token_weights;
  std::vector<float> old_logprob;
  std::vector<float> advantages;
  std::vector<float> ref_logprob;
};

struct TermResult {
  // sum_t scale w_t loss_t over counted tokens, scale = grad_scale (/ token_count for kMean): the
  // function whose gradient grad_hidden, grad_weight and grad_bias are.
  double objective = 0.0;
  double loss_sum = 0.0;  // sum_t w_t loss_t
  int64_t token_count = 0;
  std::vector<double> per_token_loss;     // N, w_t loss_t; 0 for ignored tokens
  std::vector<double> per_token_lse;      // N
  std::vector<double> per_token_logprob;  // N, z_y - lse; 0 for ignored tokens
  std::vector<double> per_token_entropy;  // N; 0 for ignored tokens
  std::vector<double> grad_hidden;        // N x D
  std::vector<double> grad_weight;        // V x D, this call's contribution
  std::vector<double> grad_bias;          // V, this call's contribution
};

// `hidden` (N x D) and `weight` (V x D) as the backend sees them; targets valid.
TermResult LossTermsReference(const Problem& problem, const std::vector<double>& hidden,
                              const std::vector<double>& weight,
                              const std::vector<int32_t>& targets, const TermInputs& inputs);

// Random term inputs for a problem (the backends' suites): with `bias`, a bias in (-0.8, 0.8);
// with `weights`, token weights in [-0.5, 2) with exact zeros; for the policy-gradient kind old
// log-probabilities that put the ratio inside and outside the clip range but never within
// `kink_margin` of its log bounds (where a backend's rounding of log p could move the ratio across
// a kink), advantages of both signs, and with kl_coef > 0 reference log-probabilities near the
// current ones: within 0.5, or with `clamped_kl` at q - log p in [3, 6] (k3 above its clamp) at
// even tokens and in [-2, 2] (below it) at odd ones, at least 3 from the bound in q - log p.
TermInputs RandomTermInputs(const Problem& problem, const std::vector<double>& hidden,
                            const std::vector<double>& weight, const std::vector<int32_t>& targets,
                            bool bias, bool weights, uint64_t seed, float kink_margin,
                            bool clamped_kl = false);

// `options` with the terms' inputs given (grad_bias asked for with a bias).
inline RunOptions WithTermInputs(RunOptions options, const TermInputs& terms) {
  options.bias = terms.bias;
  options.token_weights = terms.token_weights;
  options.old_logprob = terms.old_logprob;
  options.advantages = terms.advantages;
  options.ref_logprob = terms.ref_logprob;
  options.grad_bias = !terms.bias.empty();
  return options;
}

// Loss options of each kind, and a copy of `o` changed by `set`, for the tests' case tables.
inline LossOptions CrossEntropy(Reduction reduction = Reduction::kMean) {
  return LossOptions{.reduction = reduction};
}

inline LossOptions PolicyGradient(Reduction reduction = Reduction::kMean, float kl_coef = 0.0f) {
  LossOptions o{.reduction = reduction};
  o.kind = LossKind::kPolicyGradient;
  o.kl_coef = kl_coef;
  return o;
}

template <typename F>
LossOptions With(LossOptions o, F set) {
  set(o);
  return o;
}

// The option sets the shard suites (CPU and CUDA) run over every shard count: the logit scale
// alone; the entropy term with a soft-cap and z-loss; the clipped policy gradient with KL; and
// every option of each kind at once.
struct ShardTermOptions {
  LossOptions scale = With(CrossEntropy(), [](LossOptions& o) { o.logit_scale = 1.7f; });
  LossOptions entropy = With(CrossEntropy(Reduction::kSum), [](LossOptions& o) {
    o.entropy_coef = -0.2f;
    o.softcap = 1.5f;
    o.z_loss = 0.01f;
  });
  LossOptions policy = With(PolicyGradient(Reduction::kSum, 0.1f), [](LossOptions& o) {
    o.clip_low = 0.1f;
    o.clip_high = 0.28f;
  });
  LossOptions everything_ce = With(CrossEntropy(), [](LossOptions& o) {
    o.logit_scale = 1.3f;
    o.softcap = 2.5f;
    o.z_loss = 0.02f;
    o.label_smoothing = 0.05f;
    o.entropy_coef = 0.1f;
    o.grad_scale = 3.0f;
  });
  LossOptions everything_pg = With(PolicyGradient(Reduction::kNone, 0.05f), [](LossOptions& o) {
    o.logit_scale = 0.8f;
    o.softcap = 3.0f;
    o.z_loss = 0.02f;
    o.entropy_coef = -0.05f;
    o.grad_scale = 0.5f;
  });
};

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_LOSS_TERMS_REFERENCE_H_
