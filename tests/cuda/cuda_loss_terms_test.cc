// The model options and loss terms beyond the plain loss (problem.h: logit scale, bias and its
// gradient, per-token weights, the entropy term, the policy-gradient loss with its KL term) on the
// CUDA backend's Run, against the CPU backend (itself checked against float64 in
// tests/kernels/cpu_loss_terms_test.cc): each term alone and with the others, bf16, fp16 and fp32,
// deferred dW on and off, chunked and overlapped; with neutral inputs (bias 0, weights 1) the
// terms' kernel gives the plain kernel's bits; reruns give the same bits (grad_bias included).
//
// Tolerances: values (loss, lse, log p, entropy) within 1e-3 relative plus 1e-4 of the largest
// (the logits are fp32 GEMMs in another summation order, the row's exp is __expf); with bf16
// logits (the bf16 default, every z rounded to bf16 before the row reads it) within 3e-2. The
// gradients are rounded to the problem's dtype (G before the GEMMs on CUDA): within four of its
// ulps relative plus 2e-3 (fp32: 1e-4) of the largest; with bf16 logits 2e-2 of the largest.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "tests/cuda/cuda_testing.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/distribution_checks.h"
#include "tests/kernels/loss_terms_reference.h"
#include "tests/kernels/term_checks.h"

namespace losshead::kernels {
namespace {

using testing::ExpectWithinShare;
using testing::Inputs;
using testing::InputSpec;
using testing::MakeCuda;
using testing::MakeRandomInputs;
using testing::MaxAbs;
using testing::Outputs;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::SameFloatBits;
using testing::TermInputs;
using testing::ToDouble;

constexpr size_t kMiB = size_t{1} << 20;

struct Terms {
  bool bias = false;     // bias and grad_bias
  bool weights = false;  // token_weights
};

// Never within 0.05 of the clip's kinks: CUDA's log p is a few ulps (bf16 logits: a bf16 step)
// from the CPU's.
TermInputs RandomTermInputs(const Problem& p, const Inputs& in, const Terms& terms, uint64_t seed) {
  return testing::RandomTermInputs(p, in.hidden, in.weight, in.targets, terms.bias, terms.weights,
                                   seed, 0.05f);
}

RunOptions RunOptionsFor(const TermInputs& terms, size_t budget, bool stash) {
  RunOptions options;
  options.workspace_budget = budget;
  options.logprob = options.entropy = true;
  options.stash = stash;
  return testing::WithTermInputs(options, terms);
}

using testing::CrossEntropy;
using testing::PolicyGradient;
using testing::With;

struct Case {
  std::string name;
  DType dtype;
  LossOptions options;
  Terms terms;
  bool stash = false;
  bool bf16_logits = false;
  int row_threads = 512;
  bool overlap = false;
  int64_t n = 97, d = 64, v = 1003;
  int64_t chunk_rows = 0;  // 0: one chunk; else a budget for about this many rows per chunk
  int32_t top_k = 0;       // also asked: the top-k of the scaled, biased logits
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

size_t BudgetFor(const Case& c, const CudaBackendOptions& o) {
  if (c.chunk_rows == 0) return 64 * kMiB;
  const bool narrow = c.bf16_logits && c.dtype == DType::kBF16;
  const size_t row = ((c.v + 15) / 16 * 16) * (narrow ? 2 : 4) + 4;
  return o.cublas_workspace_bytes + o.handle_reserve_bytes + 4096 + c.chunk_rows * row;
}

testing::TermTolerance ToleranceFor(const Case& c) {
  return testing::CudaTermTolerance(c.dtype, c.bf16_logits);
}

class CudaLossTermsTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLossTermsTest, MatchesTheCpuBackend) {
  SKIP_WITHOUT_GPU();
  const Case& c = GetParam();
  const Problem p{.n = c.n, .d = c.d, .v = c.v, .dtype = c.dtype, .options = c.options};
  const uint64_t seed = std::hash<std::string>()(c.name);
  const Inputs in = MakeRandomInputs(
      p, seed, InputSpec{.hidden_scale = 1.0, .weight_scale = 0.6, .ignore_fraction = 0.2});
  const TermInputs terms = RandomTermInputs(p, in, c.terms, seed + 1);
  CudaBackendOptions o;
  o.bf16_logits = c.bf16_logits;
  o.row_threads = c.row_threads;
  o.overlap = c.overlap;
  std::unique_ptr<Backend> cuda = MakeCuda(o);
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend(4);
  const size_t budget = BudgetFor(c, o);

  RunOptions run = RunOptionsFor(terms, budget, c.stash);
  run.top_k = c.top_k;
  // The accumulators start from something, to see += rather than =.
  run.initial_grad_weight.assign(p.v * p.d, 0.25f);
  if (run.grad_bias) run.initial_grad_bias.assign(p.v, -0.5f);
  absl::StatusOr<Outputs> got = RunOnBackend(*cuda, in, run);
  ASSERT_TRUE(got.ok()) << got.status();
  RunOptions cpu_run = run;
  cpu_run.workspace_budget = 64 * kMiB;
  cpu_run.stash = false;
  absl::StatusOr<Outputs> want = RunOnBackend(*cpu, in, cpu_run);
  ASSERT_TRUE(want.ok()) << want.status();

  const testing::TermTolerance tol = ToleranceFor(c);
  EXPECT_EQ(got->token_count, want->token_count);
  EXPECT_NEAR(got->loss_sum, want->loss_sum,
              tol.value_rel * std::abs(want->loss_sum) +
                  tol.value_abs * MaxAbs(ToDouble(want->per_token_loss)) * p.n);
  ExpectWithinShare(ToDouble(got->per_token_loss), ToDouble(want->per_token_loss), tol.value_rel,
                    tol.value_abs, "per_token_loss");
  ExpectWithinShare(ToDouble(got->per_token_lse), ToDouble(want->per_token_lse), tol.value_rel,
                    tol.value_abs, "per_token_lse");
  ExpectWithinShare(ToDouble(got->per_token_logprob), ToDouble(want->per_token_logprob),
                    tol.value_rel, tol.value_abs, "per_token_logprob");
  ExpectWithinShare(ToDouble(got->per_token_entropy), ToDouble(want->per_token_entropy),
                    tol.value_rel, tol.value_abs, "per_token_entropy");
  ExpectWithinShare(got->grad_hidden, want->grad_hidden, tol.grad_rel, tol.grad_abs, "grad_hidden");
  ExpectWithinShare(ToDouble(got->grad_weight), ToDouble(want->grad_weight), tol.grad_rel,
                    tol.grad_abs, "grad_weight");
  if (run.grad_bias) {
    ExpectWithinShare(ToDouble(got->grad_bias), ToDouble(want->grad_bias), tol.grad_rel,
                      tol.grad_abs, "grad_bias");
  }
  if (c.top_k > 0) {
    ASSERT_EQ(got->top_k_ids.size(), static_cast<size_t>(p.n * c.top_k));
    ASSERT_EQ(got->top_k_ids.size(), want->top_k_ids.size());
    ExpectWithinShare(ToDouble(got->top_k_logprobs), ToDouble(want->top_k_logprobs), tol.value_rel,
                      tol.value_abs, "top_k_logprobs");
    // The ids too, but where two classes' z are closer than the logits' rounding (near-ties).
    size_t differ = 0;
    for (size_t i = 0; i < got->top_k_ids.size(); ++i)
      differ += got->top_k_ids[i] != want->top_k_ids[i];
    EXPECT_LE(differ, got->top_k_ids.size() / 50) << "top-k ids that differ from the CPU's";
  }
  // Ignored tokens: no loss, no gradient.
  for (int64_t t = 0; t < p.n; ++t) {
    if (in.targets[t] != p.options.ignore_index) continue;
    EXPECT_EQ(got->per_token_loss[t], 0.0f) << "token " << t;
    for (int64_t k = 0; k < p.d; ++k) ASSERT_EQ(got->grad_hidden[t * p.d + k], 0.0) << t;
  }
  // A rerun gives the same bits, grad_bias's column sums included.
  absl::StatusOr<Outputs> again = RunOnBackend(*cuda, in, run);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(SameFloatBits(again->per_token_loss, got->per_token_loss));
  EXPECT_TRUE(SameFloatBits(again->grad_weight, got->grad_weight));
  EXPECT_TRUE(SameFloatBits(again->grad_bias, got->grad_bias));
  EXPECT_EQ(again->grad_hidden, got->grad_hidden);
}

INSTANTIATE_TEST_SUITE_P(
    Terms, CudaLossTermsTest,
    ::testing::Values(
        Case{.name = "FP32_Scale",
             .dtype = DType::kFP32,
             .options = With(CrossEntropy(), [](LossOptions& o) { o.logit_scale = 1.7f; })},
        Case{.name = "BF16_Temperature_Softcap_Stash",
             .dtype = DType::kBF16,
             .options = With(CrossEntropy(Reduction::kSum),
                             [](LossOptions& o) {
                               o.logit_scale = 1.0f / 0.7f;
                               o.softcap = 2.0f;
                             }),
             .stash = true},
        Case{.name = "BF16_Bias",
             .dtype = DType::kBF16,
             .options = CrossEntropy(),
             .terms = {.bias = true}},
        Case{.name = "FP16_Bias_Scale_Chunked",
             .dtype = DType::kFP16,
             .options = With(CrossEntropy(Reduction::kSum),
                             [](LossOptions& o) { o.logit_scale = 0.6f; }),
             .terms = {.bias = true},
             .chunk_rows = 32},
        Case{.name = "FP16_Weights_LabelSmoothing",
             .dtype = DType::kFP16,
             .options = With(CrossEntropy(Reduction::kNone),
                             [](LossOptions& o) { o.label_smoothing = 0.1f; }),
             .terms = {.weights = true}},
        Case{.name = "FP32_Entropy_TopK",
             .dtype = DType::kFP32,
             .options = With(CrossEntropy(), [](LossOptions& o) { o.entropy_coef = 0.3f; }),
             .top_k = 5},
        Case{.name = "BF16_EntropyNegative_Softcap_ZLoss_Stash",
             .dtype = DType::kBF16,
             .options = With(CrossEntropy(Reduction::kSum),
                             [](LossOptions& o) {
                               o.entropy_coef = -0.2f;
                               o.softcap = 1.5f;
                               o.z_loss = 0.01f;
                             }),
             .stash = true},
        Case{.name = "FP32_PolicyGradient", .dtype = DType::kFP32, .options = PolicyGradient()},
        Case{.name = "BF16_PolicyGradient_Kl_AsymmetricClip",
             .dtype = DType::kBF16,
             .options = With(PolicyGradient(Reduction::kSum, 0.1f),
                             [](LossOptions& o) {
                               o.clip_low = 0.1f;
                               o.clip_high = 0.28f;
                             })},
        Case{.name = "FP16_PolicyGradient_Everything",
             .dtype = DType::kFP16,
             .options = With(PolicyGradient(Reduction::kMean, 0.05f),
                             [](LossOptions& o) {
                               o.logit_scale = 0.8f;
                               o.softcap = 3.0f;
                               o.z_loss = 0.02f;
                               o.entropy_coef = -0.05f;
                               o.grad_scale = 0.5f;
                             }),
             .terms = {.bias = true, .weights = true}},
        Case{.name = "FP32_PolicyGradient_Everything_Stash_Chunked_1024Threads",
             .dtype = DType::kFP32,
             .options = With(PolicyGradient(Reduction::kNone, 0.05f),
                             [](LossOptions& o) {
                               o.logit_scale = 1.25f;
                               o.z_loss = 0.02f;
                               o.entropy_coef = 0.05f;
                             }),
             .terms = {.bias = true, .weights = true},
             .stash = true,
             .row_threads = 1024,
             .chunk_rows = 40,
             .top_k = 16},
        Case{.name = "BF16_CrossEntropy_Everything_Overlap",
             .dtype = DType::kBF16,
             .options = With(CrossEntropy(Reduction::kMean),
                             [](LossOptions& o) {
                               o.logit_scale = 1.3f;
                               o.softcap = 2.5f;
                               o.z_loss = 0.02f;
                               o.label_smoothing = 0.05f;
                               o.entropy_coef = 0.1f;
                               o.grad_scale = 3.0f;
                             }),
             .terms = {.bias = true, .weights = true},
             .overlap = true,
             .n = 1100,
             .v = 515,
             .top_k = 7},
        Case{.name = "BF16_CrossEntropy_Everything_Bf16Logits_Stash",
             .dtype = DType::kBF16,
             .options = With(CrossEntropy(Reduction::kMean),
                             [](LossOptions& o) {
                               o.logit_scale = 1.3f;
                               o.softcap = 2.5f;
                               o.entropy_coef = 0.1f;
                             }),
             .terms = {.bias = true, .weights = true},
             .stash = true,
             .bf16_logits = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// With neutral inputs (a zero bias, unit weights) and no term of the options on, the terms'
// instantiation computes what the plain one does, bit for bit: the loss, lse, dH, dW; grad_bias is
// then the plain gradient's column sums.
TEST(CudaLossTermsBits, NeutralInputsGiveThePlainKernelsBits) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Problem p{.n = 70,
                    .d = 48,
                    .v = 517,
                    .dtype = dtype,
                    .options = LossOptions{.label_smoothing = 0.1f, .z_loss = 1e-3f}};
    const Inputs in =
        MakeRandomInputs(p, 17, InputSpec{.weight_scale = 0.6, .ignore_fraction = 0.2});
    std::unique_ptr<Backend> cuda = MakeCuda();
    ASSERT_NE(cuda, nullptr);
    RunOptions plain;
    absl::StatusOr<Outputs> want = RunOnBackend(*cuda, in, plain);
    ASSERT_TRUE(want.ok()) << want.status();
    RunOptions neutral;
    neutral.bias.assign(p.v, 0.0f);
    neutral.grad_bias = true;
    neutral.token_weights.assign(p.n, 1.0f);
    absl::StatusOr<Outputs> got = RunOnBackend(*cuda, in, neutral);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->loss_sum, want->loss_sum);
    EXPECT_TRUE(SameFloatBits(got->per_token_loss, want->per_token_loss));
    EXPECT_TRUE(SameFloatBits(got->per_token_lse, want->per_token_lse));
    EXPECT_EQ(got->grad_hidden, want->grad_hidden);
    EXPECT_TRUE(SameFloatBits(got->grad_weight, want->grad_weight));
    // sum_t dloss/dx_j over the tokens: what the CPU computes, within the GEMMs' tolerance.
    std::unique_ptr<Backend> cpu = CreateCpuBackend(2);
    absl::StatusOr<Outputs> host = RunOnBackend(*cpu, in, neutral);
    ASSERT_TRUE(host.ok()) << host.status();
    ExpectWithinShare(ToDouble(got->grad_bias), ToDouble(host->grad_bias),
                      std::max(4 * testing::UnitRoundoff(dtype), 1e-5), 2e-3, "grad_bias");
  }
}

// Inconsistent inputs are refused before anything is launched (INVALID_ARGUMENT naming the field).
TEST(CudaLossTermsErrors, InconsistentInputsAreInvalidArgument) {
  SKIP_WITHOUT_GPU();
  const Problem p{.n = 8, .d = 16, .v = 64, .dtype = DType::kFP32};
  const Inputs in = MakeRandomInputs(p, 3);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  RunOptions grad_bias_alone;
  grad_bias_alone.grad_bias = true;
  absl::StatusOr<Outputs> r = RunOnBackend(*cuda, in, grad_bias_alone);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("grad_bias"), std::string::npos) << r.status();
  RunOptions advantages_with_cross_entropy;
  advantages_with_cross_entropy.advantages.assign(p.n, 1.0f);
  r = RunOnBackend(*cuda, in, advantages_with_cross_entropy);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("advantages"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace losshead::kernels
