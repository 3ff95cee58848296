// The model options and loss terms beyond the plain loss (problem.h: logit scale, bias and its
// gradient, per-token weights, the entropy term, the policy-gradient loss with its KL term) on
// the CPU backend's Run: the float64 reference's gradients against central differences of its
// loss; the backend against the reference, each term alone and with the others, with label
// smoothing, z-loss, the soft-cap, ignored tokens, every reduction and dtype; the terms' row with
// neutral inputs against the plain row, bit for bit; the error paths; the shards' refusal.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/loss_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/grad_stash.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/distribution_checks.h"
#include "tests/kernels/loss_terms_reference.h"

namespace losshead::kernels {
namespace {

using testing::Inputs;
using testing::InputSpec;
using testing::LossTermsReference;
using testing::MakeRandomInputs;
using testing::MaxAbs;
using testing::Outputs;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::SameFloatBits;
using testing::TermInputs;
using testing::TermResult;
using testing::ToDouble;
using testing::WorstToleranceRatio;

// Which inputs a case gives.
struct Terms {
  bool bias = false;     // bias and grad_bias
  bool weights = false;  // token_weights
  // With kl_coef > 0, reference log-probs that put k3 above its clamp at even tokens (q - log p in
  // [3, 6]) and below it at odd ones (in [-2, 2]), at least 3 from the bound in q - log p.
  bool clamped_kl = false;
};

// Random term inputs for `in` (loss_terms_reference.h), never within 0.02 of the clip's kinks.
TermInputs RandomTermInputs(const Problem& p, const Inputs& in, const Terms& terms, uint64_t seed) {
  return testing::RandomTermInputs(p, in.hidden, in.weight, in.targets, terms.bias, terms.weights,
                                   seed, 0.02f, terms.clamped_kl);
}

RunOptions RunOptionsFor(const TermInputs& terms, size_t workspace_budget) {
  RunOptions options;
  options.workspace_budget = workspace_budget;
  options.logprob = options.entropy = true;
  return testing::WithTermInputs(options, terms);
}

// ---------------------------------------------------------------------------------------------
// The reference's gradients against central differences of its own loss, in float64 on small
// problems: every coordinate of H, W and b.

struct FdCase {
  std::string name;
  LossOptions options;
  Terms terms;
};

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class LossTermsReferenceGradientTest : public ::testing::TestWithParam<FdCase> {};

TEST_P(LossTermsReferenceGradientTest, MatchesCentralDifferences) {
  const FdCase& c = GetParam();
  // fp32 problems: the inputs are exact doubles, and the differences are taken in double.
  const Problem p{.n = 6, .d = 5, .v = 11, .dtype = DType::kFP32, .options = c.options};
  Inputs in = MakeRandomInputs(p, std::hash<std::string>()(c.name),
                               InputSpec{.hidden_scale = 1.0, .weight_scale = 0.8});
  in.targets[2] = static_cast<int32_t>(p.options.ignore_index);
  TermInputs terms = RandomTermInputs(p, in, c.terms, 17 + c.name.size());
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);
  ASSERT_EQ(ref.token_count, p.n - 1);

  // J(x) with one input changed by +-step; the derivative by the central difference.
  constexpr double kStep = 1e-5;
  auto difference = [&](std::function<void(double)> shift) {
    shift(kStep);
    const double plus = LossTermsReference(p, in.hidden, in.weight, in.targets, terms).objective;
    shift(-2 * kStep);
    const double minus = LossTermsReference(p, in.hidden, in.weight, in.targets, terms).objective;
    shift(kStep);
    return (plus - minus) / (2 * kStep);
  };
  auto expect_close = [](double analytic, double numeric, const std::string& what) {
    EXPECT_NEAR(analytic, numeric, 1e-7 * (1.0 + std::abs(numeric))) << what;
  };
  for (size_t i = 0; i < in.hidden.size(); ++i) {
    expect_close(ref.grad_hidden[i], difference([&](double s) { in.hidden[i] += s; }),
                 "dH[" + std::to_string(i) + "]");
  }
  for (size_t i = 0; i < in.weight.size(); ++i) {
    expect_close(ref.grad_weight[i], difference([&](double s) { in.weight[i] += s; }),
                 "dW[" + std::to_string(i) + "]");
  }
  if (!terms.bias.empty()) {
    // The bias is fp32, as the API takes it: a step of a float, the difference divided by the
    // step the rounding left.
    for (size_t j = 0; j < terms.bias.size(); ++j) {
      const float base = terms.bias[j];
      terms.bias[j] = base + 0x1p-12f;
      const double plus = LossTermsReference(p, in.hidden, in.weight, in.targets, terms).objective;
      const double up = static_cast<double>(terms.bias[j]) - base;
      terms.bias[j] = base - 0x1p-12f;
      const double minus = LossTermsReference(p, in.hidden, in.weight, in.targets, terms).objective;
      const double down = static_cast<double>(terms.bias[j]) - base;
      terms.bias[j] = base;
      // A step of 2^-12 leaves an O(step^2) error: looser than H's and W's.
      EXPECT_NEAR(ref.grad_bias[j], (plus - minus) / (up - down),
                  1e-5 * (1.0 + std::abs(ref.grad_bias[j])))
          << "db[" << j << "]";
    }
  }
  // The objective is the per-token losses, weighted and scaled as the reduction says.
  double scale = p.options.grad_scale;
  if (p.options.reduction == Reduction::kMean) scale /= ref.token_count;
  EXPECT_NEAR(ref.objective, scale * ref.loss_sum, 1e-12 * (1.0 + std::abs(ref.objective)));
}

using testing::CrossEntropy;
using testing::PolicyGradient;
using testing::With;

INSTANTIATE_TEST_SUITE_P(
    Terms, LossTermsReferenceGradientTest,
    ::testing::Values(
        FdCase{"Scale", With(CrossEntropy(), [](LossOptions& o) { o.logit_scale = 1.7f; }), {}},
        FdCase{"Temperature_Softcap",
               With(CrossEntropy(Reduction::kSum),
                    [](LossOptions& o) {
                      o.logit_scale = 1.0f / 0.7f;
                      o.softcap = 2.0f;
                    }),
               {}},
        FdCase{"Bias", CrossEntropy(), {.bias = true}},
        FdCase{
            "Weights_LabelSmoothing",
            With(CrossEntropy(Reduction::kNone), [](LossOptions& o) { o.label_smoothing = 0.1f; }),
            {.weights = true}},
        FdCase{"Entropy", With(CrossEntropy(), [](LossOptions& o) { o.entropy_coef = 0.3f; }), {}},
        FdCase{"EntropyNegative_Softcap_ZLoss",
               With(CrossEntropy(Reduction::kSum),
                    [](LossOptions& o) {
                      o.entropy_coef = -0.2f;
                      o.softcap = 1.5f;
                      o.z_loss = 0.01f;
                    }),
               {}},
        FdCase{"PolicyGradient", PolicyGradient(), {}},
        FdCase{"PolicyGradient_Kl_AsymmetricClip",
               With(PolicyGradient(Reduction::kSum, 0.1f),
                    [](LossOptions& o) {
                      o.clip_low = 0.1f;
                      o.clip_high = 0.28f;
                    }),
               {}},
        // Away from the KL clamp's bound, on both sides of it: no gradient above.
        FdCase{"PolicyGradient_KlClamped",
               With(PolicyGradient(Reduction::kSum, 0.3f), [](LossOptions& o) {}),
               {.clamped_kl = true}},
        FdCase{"PolicyGradient_Everything",
               With(PolicyGradient(Reduction::kMean, 0.05f),
                    [](LossOptions& o) {
                      o.logit_scale = 0.8f;
                      o.softcap = 3.0f;
                      o.z_loss = 0.02f;
                      o.entropy_coef = -0.05f;
                      o.grad_scale = 0.5f;
                    }),
               {.bias = true, .weights = true}},
        FdCase{"CrossEntropy_Everything",
               With(CrossEntropy(Reduction::kMean),
                    [](LossOptions& o) {
                      o.logit_scale = 1.3f;
                      o.softcap = 2.5f;
                      o.z_loss = 0.02f;
                      o.label_smoothing = 0.05f;
                      o.entropy_coef = 0.1f;
                      o.grad_scale = 3.0f;
                    }),
               {.bias = true, .weights = true}}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// The backend against the reference.

struct Tolerance {
  double grad_hidden_rel;  // one ulp of the dtype
  double grad_hidden_abs;  // the fp16 subnormal step
};

Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return {0x1p-7, 0.0};
    case DType::kFP16:
      return {0x1p-10, 0x1p-24};
    case DType::kFP32:
      return {1e-5, 0.0};
  }
  return {};
}

struct Case {
  std::string name;
  int64_t n, d, v;
  DType dtype;
  LossOptions options;
  Terms terms;
  double ignore_fraction = 0.0;
  size_t workspace_budget = size_t{64} << 20;  // small ones split the tokens into chunks
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CpuLossTermsTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuLossTermsTest, MatchesFloat64Reference) {
  const Case& c = GetParam();
  const Problem p{.n = c.n, .d = c.d, .v = c.v, .dtype = c.dtype, .options = c.options};
  const uint64_t seed = std::hash<std::string>()(c.name);
  const Inputs in = MakeRandomInputs(
      p, seed,
      InputSpec{.hidden_scale = 1.0, .weight_scale = 0.7, .ignore_fraction = c.ignore_fraction});
  const TermInputs terms = RandomTermInputs(p, in, c.terms, seed + 1);
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);
  RunOptions run = RunOptionsFor(terms, c.workspace_budget);
  // The accumulators start from something, to see += rather than =.
  run.initial_grad_weight.resize(p.v * p.d);
  for (size_t i = 0; i < run.initial_grad_weight.size(); ++i) {
    run.initial_grad_weight[i] = 0.01f * static_cast<float>(i % 13);
  }
  if (run.grad_bias) {
    run.initial_grad_bias.resize(p.v);
    for (size_t j = 0; j < run.initial_grad_bias.size(); ++j) {
      run.initial_grad_bias[j] = -0.02f * static_cast<float>(j % 5);
    }
  }
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, run);
  ASSERT_TRUE(out.ok()) << out.status();

  constexpr double kLossRel = 2e-6;
  EXPECT_EQ(out->token_count, ref.token_count);
  EXPECT_GT(ref.token_count, 0);
  EXPECT_NEAR(out->loss_sum, ref.loss_sum, kLossRel * (MaxAbs(ref.per_token_loss) + 1.0) * p.n);
  EXPECT_LE(WorstToleranceRatio(ToDouble(out->per_token_loss), ref.per_token_loss, kLossRel,
                                kLossRel * (MaxAbs(ref.per_token_loss) + 1.0)),
            1.0)
      << "per_token_loss";
  for (const auto& [actual, expected, name] :
       {std::tuple{&out->per_token_lse, &ref.per_token_lse, "per_token_lse"},
        std::tuple{&out->per_token_logprob, &ref.per_token_logprob, "per_token_logprob"},
        std::tuple{&out->per_token_entropy, &ref.per_token_entropy, "per_token_entropy"}}) {
    EXPECT_LE(WorstToleranceRatio(ToDouble(*actual), *expected, kLossRel, kLossRel), 1.0) << name;
  }
  for (int64_t t = 0; t < p.n; ++t) {
    if (in.targets[t] == p.options.ignore_index) {
      EXPECT_EQ(out->per_token_loss[t], 0.0f) << "token " << t;
    }
  }
  const Tolerance tol = ToleranceFor(p.dtype);
  EXPECT_LE(WorstToleranceRatio(out->grad_hidden, ref.grad_hidden, tol.grad_hidden_rel,
                                1e-6 * MaxAbs(ref.grad_hidden) + tol.grad_hidden_abs),
            1.0)
      << "grad_hidden";
  std::vector<double> expected_dw = ref.grad_weight;
  for (size_t i = 0; i < expected_dw.size(); ++i) expected_dw[i] += run.initial_grad_weight[i];
  EXPECT_LE(WorstToleranceRatio(ToDouble(out->grad_weight), expected_dw, 1e-5,
                                1e-6 * MaxAbs(ref.grad_weight)),
            1.0)
      << "grad_weight";
  if (run.grad_bias) {
    std::vector<double> expected_db = ref.grad_bias;
    for (size_t j = 0; j < expected_db.size(); ++j) expected_db[j] += run.initial_grad_bias[j];
    EXPECT_LE(WorstToleranceRatio(ToDouble(out->grad_bias), expected_db, 1e-5,
                                  1e-6 * MaxAbs(ref.grad_bias)),
              1.0)
        << "grad_bias";
    EXPECT_GT(MaxAbs(ref.grad_bias), 0.0);
  }
  EXPECT_GT(MaxAbs(ref.grad_hidden), 0.0);
}

constexpr size_t kChunked = size_t{96} << 10;

INSTANTIATE_TEST_SUITE_P(
    Terms, CpuLossTermsTest,
    ::testing::Values(
        // Each term alone.
        Case{"FP32_Scale_Mean", 37, 67, 1000, DType::kFP32,
             With(CrossEntropy(), [](LossOptions& o) { o.logit_scale = 0.7f; })},
        Case{"BF16_Temperature_Softcap_Sum", 37, 67, 997, DType::kBF16,
             With(CrossEntropy(Reduction::kSum),
                  [](LossOptions& o) {
                    o.logit_scale = 1.0f / 0.6f;
                    o.softcap = 5.0f;
                  })},
        Case{"FP32_Bias_Mean", 37, 67, 1000, DType::kFP32, CrossEntropy(), {.bias = true}},
        Case{"FP16_Bias_Softcap_LabelSmoothing_None",
             37,
             67,
             997,
             DType::kFP16,
             With(CrossEntropy(Reduction::kNone),
                  [](LossOptions& o) {
                    o.softcap = 3.0f;
                    o.label_smoothing = 0.1f;
                  }),
             {.bias = true}},
        Case{"BF16_Weights_Mean_Ignored",
             48,
             67,
             1000,
             DType::kBF16,
             CrossEntropy(),
             {.weights = true},
             0.3},
        Case{"FP32_Weights_ZLoss_Sum",
             48,
             67,
             997,
             DType::kFP32,
             With(CrossEntropy(Reduction::kSum), [](LossOptions& o) { o.z_loss = 1e-3f; }),
             {.weights = true}},
        Case{"FP32_Entropy_Mean", 37, 67, 1000, DType::kFP32,
             With(CrossEntropy(), [](LossOptions& o) { o.entropy_coef = 0.05f; })},
        Case{"BF16_EntropyNegative_Softcap_ZLoss_Sum",
             37,
             67,
             997,
             DType::kBF16,
             With(CrossEntropy(Reduction::kSum),
                  [](LossOptions& o) {
                    o.entropy_coef = -0.1f;
                    o.softcap = 4.0f;
                    o.z_loss = 1e-3f;
                  }),
             {},
             0.2},
        Case{"FP32_PolicyGradient_Mean", 48, 67, 1000, DType::kFP32, PolicyGradient()},
        Case{"BF16_PolicyGradient_Kl_Sum_Ignored",
             48,
             67,
             997,
             DType::kBF16,
             PolicyGradient(Reduction::kSum, 0.04f),
             {},
             0.3},
        Case{"FP16_PolicyGradient_Kl_None", 48, 67, 1000, DType::kFP16,
             With(PolicyGradient(Reduction::kNone, 0.1f),
                  [](LossOptions& o) {
                    o.clip_low = 0.2f;
                    o.clip_high = 0.28f;
                  })},
        // All together.
        Case{"BF16_CrossEntropy_Everything_Chunked",
             150,
             67,
             997,
             DType::kBF16,
             With(CrossEntropy(Reduction::kMean),
                  [](LossOptions& o) {
                    o.logit_scale = 1.25f;
                    o.softcap = 6.0f;
                    o.z_loss = 1e-3f;
                    o.label_smoothing = 0.1f;
                    o.entropy_coef = -0.02f;
                    o.grad_scale = 2.0f;
                  }),
             {.bias = true, .weights = true},
             0.25,
             kChunked},
        Case{"FP32_PolicyGradient_Everything_Chunked",
             150,
             67,
             997,
             DType::kFP32,
             With(PolicyGradient(Reduction::kMean, 0.05f),
                  [](LossOptions& o) {
                    o.logit_scale = 0.9f;
                    o.softcap = 8.0f;
                    o.z_loss = 1e-4f;
                    o.entropy_coef = 0.01f;
                  }),
             {.bias = true, .weights = true},
             0.25,
             kChunked},
        Case{"FP16_PolicyGradient_Everything_Sum",
             40,
             33,
             1000,
             DType::kFP16,
             With(PolicyGradient(Reduction::kSum, 0.02f),
                  [](LossOptions& o) {
                    o.logit_scale = 1.1f;
                    o.softcap = 10.0f;
                    o.entropy_coef = -0.01f;
                    o.grad_scale = 0.25f;
                  }),
             {.bias = true, .weights = true},
             0.1}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Bit for bit: with neutral inputs (a zero bias, weights of 1) the terms' row computes what the
// plain row does, and asking for grad_bias changes no other output.

// Every output of `a` is `b`'s, bit for bit: the loss outputs and the distribution's.
void ExpectSameBits(const Outputs& a, const Outputs& b) {
  testing::ExpectSameLossBits(a, b);
  EXPECT_TRUE(SameFloatBits(a.per_token_logprob, b.per_token_logprob)) << "per_token_logprob";
  EXPECT_TRUE(SameFloatBits(a.per_token_entropy, b.per_token_entropy)) << "per_token_entropy";
}

TEST(CpuLossTermsBits, NeutralInputsGiveThePlainRowsBits) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const LossOptions& options :
         {CrossEntropy(Reduction::kMean), With(CrossEntropy(Reduction::kSum), [](LossOptions& o) {
            o.label_smoothing = 0.1f;
            o.z_loss = 1e-3f;
            o.softcap = 5.0f;
          })}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dtype) << (options.softcap > 0.0f ? " all options" : " plain"));
      const Problem p{.n = 40, .d = 33, .v = 301, .dtype = dtype, .options = options};
      const Inputs in = MakeRandomInputs(p, 4343, InputSpec{.ignore_fraction = 0.25});
      std::unique_ptr<Backend> backend = CreateCpuBackend(2);
      RunOptions plain;
      plain.logprob = plain.entropy = true;
      absl::StatusOr<Outputs> a = RunOnBackend(*backend, in, plain);
      ASSERT_TRUE(a.ok()) << a.status();
      RunOptions neutral = plain;
      neutral.bias.assign(p.v, 0.0f);
      neutral.token_weights.assign(p.n, 1.0f);
      neutral.grad_bias = true;
      absl::StatusOr<Outputs> b = RunOnBackend(*backend, in, neutral);
      ASSERT_TRUE(b.ok()) << b.status();
      ExpectSameBits(*a, *b);
      // grad_bias is the column sums of the same G.
      EXPECT_GT(MaxAbs(ToDouble(b->grad_bias)), 0.0);
    }
  }
}

// kMean divides by the counted tokens whatever the weights (problem.h): weights w give the
// gradient of weights 1 times w where w is one number for every token.
TEST(CpuLossTermsBits, MeanDividesByTokenCountNotByTheWeights) {
  const Problem p{.n = 32, .d = 33, .v = 257, .dtype = DType::kFP32, .options = CrossEntropy()};
  const Inputs in = MakeRandomInputs(p, 99, InputSpec{.ignore_fraction = 0.25});
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  RunOptions ones, fours;
  ones.token_weights.assign(p.n, 1.0f);
  fours.token_weights.assign(p.n, 4.0f);
  absl::StatusOr<Outputs> a = RunOnBackend(*backend, in, ones);
  absl::StatusOr<Outputs> b = RunOnBackend(*backend, in, fours);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->token_count, b->token_count);
  EXPECT_EQ(b->loss_sum, 4.0f * a->loss_sum);  // a power of two scales exactly
  for (size_t i = 0; i < a->grad_weight.size(); ++i) {
    ASSERT_EQ(b->grad_weight[i], 4.0f * a->grad_weight[i]) << i;
  }
}

// Deferred dW: the stash holds G with the token weights and the logit scale already in it, so a
// flush gives the dW a direct call accumulates; dH and grad_bias are the same bits either way.
TEST(CpuLossTermsStash, FlushedStashGivesTheDirectGradient) {
  Problem p{.n = 48, .d = 33, .v = 301, .dtype = DType::kBF16};
  p.options = With(PolicyGradient(Reduction::kMean, 0.05f), [](LossOptions& o) {
    o.logit_scale = 0.8f;
    o.entropy_coef = 0.02f;
    o.softcap = 6.0f;
  });
  const Inputs in = MakeRandomInputs(p, 4848, InputSpec{.ignore_fraction = 0.2});
  const TermInputs terms = RandomTermInputs(p, in, {.bias = true, .weights = true}, 4849);
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> direct =
      RunOnBackend(*backend, in, RunOptionsFor(terms, size_t{64} << 20));
  ASSERT_TRUE(direct.ok()) << direct.status();

  absl::StatusOr<size_t> stash_bytes = backend->GradStashBytes(p, p.n);
  absl::StatusOr<size_t> workspace_bytes = backend->WorkspaceBytes(p, size_t{64} << 20);
  ASSERT_TRUE(stash_bytes.ok() && workspace_bytes.ok());
  absl::StatusOr<DeviceBuffer> stash = backend->Allocate(*stash_bytes);
  absl::StatusOr<DeviceBuffer> workspace = backend->Allocate(*workspace_bytes);
  ASSERT_TRUE(stash.ok() && workspace.ok());
  std::vector<uint8_t> grad_hidden(in.hidden_bytes.size());
  std::vector<float> grad_bias(p.v, 0.0f), grad_weight(p.v * p.d, 0.0f);
  float loss_sum = 0.0f;
  int64_t token_count = 0;
  Arguments args;
  args.hidden = in.hidden_bytes.data();
  args.weight = in.weight_bytes.data();
  args.targets = in.targets.data();
  args.grad_hidden = grad_hidden.data();
  args.grad_stash = GradStash{stash->data(), p.n, 0};
  args.loss_sum = &loss_sum;
  args.token_count = &token_count;
  args.bias = terms.bias.data();
  args.grad_bias = grad_bias.data();
  args.token_weights = terms.token_weights.data();
  args.old_logprob = terms.old_logprob.data();
  args.advantages = terms.advantages.data();
  args.ref_logprob = terms.ref_logprob.data();
  args.workspace = workspace->data();
  args.workspace_bytes = *workspace_bytes;
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(backend->Run(p, args, **stream).ok());
  ASSERT_TRUE(backend
                  ->FlushGradStash(p, GradStash{stash->data(), p.n, p.n}, grad_weight.data(),
                                   workspace->data(), *workspace_bytes, **stream)
                  .ok());

  EXPECT_EQ(loss_sum, direct->loss_sum);
  EXPECT_TRUE(SameFloatBits(grad_bias, direct->grad_bias));
  std::vector<float> decoded(p.n * p.d);
  ToFloat(p.dtype, grad_hidden.data(), decoded.data(), decoded.size());
  EXPECT_EQ(ToDouble(decoded), direct->grad_hidden);
  EXPECT_LE(WorstToleranceRatio(ToDouble(grad_weight), ref.grad_weight, 1e-5,
                                1e-6 * MaxAbs(ref.grad_weight)),
            1.0);
  EXPECT_GT(MaxAbs(ref.grad_weight), 0.0);
}

// ---------------------------------------------------------------------------------------------
// The clip's gradient at and around its bounds, as PyTorch's autograd gives it for
// -torch.min(r * A, torch.clamp(r, lo, hi) * A) (values worked out from its backward formulas:
// minimum splits a tie in halves, clamp passes the gradient at its bounds).

TEST(LossMathPolicyGradient, ClipSlopeFollowsAutogradAtTheBounds) {
  const double lo = 0.8, hi = 1.2;
  struct Point {
    double r, a, slope;
  };
  for (const Point& x : std::vector<Point>{
           {1.0, 2.0, -2.0},  // inside: a tie, half through each branch, clamp passing
           {1.2, 2.0, -2.0},  // at hi: clamp(r) = r, a tie, and clamp passes at its bound
           {0.8, -3.0, 3.0},  // at lo, likewise
           {1.3, 2.0, 0.0},   // above hi, A > 0: min is the clipped branch, clamp stops
           {1.3, -2.0, 2.0},  // above hi, A < 0: min is the unclipped branch
           {0.5, 2.0, -2.0},  // below lo, A > 0: unclipped
           {0.5, -2.0, 0.0},  // below lo, A < 0: clipped, stopped
           {1.3, 0.0, -0.0},  // A = 0: a tie outside the range, half of 0
       }) {
    EXPECT_EQ(loss::ClippedPolicySlope(x.r, x.a, lo, hi), x.slope) << x.r << " " << x.a;
    EXPECT_EQ(loss::ClippedPolicyTerm(x.r, x.a, lo, hi),
              -std::min(x.r * x.a, std::clamp(x.r, lo, hi) * x.a));
  }
  // A tie outside the range from rounding: r A == hi A with r > hi gives half the gradient.
  const double r = 1.2000000000000002, a = 1e-300 * 0x1p-60;
  ASSERT_GT(r, hi);
  ASSERT_EQ(r * a, hi * a);
  EXPECT_EQ(loss::ClippedPolicySlope(r, a, lo, hi), -a / 2);
  // The k3 term is 0 with its slope at q = log p, and > 0 elsewhere.
  EXPECT_EQ(loss::KlTerm(0.1, -2.0, -2.0), 0.0);
  EXPECT_EQ(loss::KlSlope(0.1, -2.0, -2.0), 0.0);
  EXPECT_GT(loss::KlTerm(0.1, -1.0, -2.0), 0.0);
  EXPECT_GT(loss::KlTerm(0.1, -3.0, -2.0), 0.0);
}

// ---------------------------------------------------------------------------------------------
// The KL term's clamp, torch.clamp(k3, max=10) under autograd: the value and gradient of tokens
// whose k3 lies above the clamp (on both sides of q = log p), below it, and exactly at it (where
// the gradient passes), the backend against the reference.

// Exactly at the bound, in the T the backends evaluate it in: a d = q - log p with k3(d) = 10 to
// the last bit, found next to the negative root d_ = e^d_ - 11 (where k3's slope is about -1, so
// that consecutive d step k3 by about one ulp). The term is 10 and the gradient passes; below the
// first d whose k3 rounds above 10, the term is 10 and no gradient.
template <typename T>
void ExpectKlClampAtTheBound() {
  T d = T(-11);
  for (int i = 0; i < 8; ++i) d = static_cast<T>(std::exp(static_cast<double>(d)) - 11.0);
  const T clamp = static_cast<T>(loss::kKlClamp);
  T at = d;  // the first d at or after 64 steps below the root with k3(d) = 10
  for (int i = 0; i < 64; ++i) at = std::nextafter(at, T(-100));
  for (int i = 0; i < 128 && loss::KlK3(at) != clamp; ++i) at = std::nextafter(at, T(0));
  ASSERT_EQ(loss::KlK3(at), clamp);
  const T kl = T(0.5);
  // q = at, log p = 0: d as the kernels form it.
  EXPECT_EQ(loss::KlTerm(kl, at, T(0)), kl * clamp);
  EXPECT_EQ(loss::KlSlope(kl, at, T(0)), kl * (T(1) - loss::Exp(at)));
  EXPECT_GT(loss::KlSlope(kl, at, T(0)), T(0.49));
  T beyond = at;  // the next d below whose k3 rounds above the clamp
  for (int i = 0; i < 16 && loss::KlK3(beyond) <= clamp; ++i) {
    beyond = std::nextafter(beyond, T(-100));
  }
  ASSERT_GT(loss::KlK3(beyond), clamp);
  EXPECT_EQ(loss::KlTerm(kl, beyond, T(0)), kl * clamp);
  EXPECT_EQ(loss::KlSlope(kl, beyond, T(0)), T(0));
}

TEST(LossTermsKlClamp, ExactlyAtTheBoundTheGradientPasses) {
  ExpectKlClampAtTheBound<double>();
  ExpectKlClampAtTheBound<float>();
}

TEST(CpuLossTermsKlClamp, AboveBelowAndAtTheBoundMatchTheReference) {
  // d = 1: every logit is a weight, exact in both. The backend's log p agrees with the
  // reference's to some 1e-15, far inside the float step of q that separates the tokens placed
  // next to the bound.
  Problem p{.n = 8, .d = 1, .v = 3, .dtype = DType::kFP32};
  p.options = PolicyGradient(Reduction::kSum, 0.5f);
  Inputs in = MakeRandomInputs(p, 77);
  in.hidden.assign(p.n, 1.0);
  in.targets.assign(p.n, 0);
  in.weight = {0.0, -1.0, -2.5};
  const float weights[] = {0.0f, -1.0f, -2.5f};
  std::memcpy(in.weight_bytes.data(), weights, sizeof(weights));
  const std::vector<float> ones(p.n, 1.0f);
  std::memcpy(in.hidden_bytes.data(), ones.data(), ones.size() * sizeof(float));
  TermInputs terms;
  terms.ref_logprob.assign(p.n, 0.0f);
  terms.old_logprob.assign(p.n, 0.0f);
  terms.advantages.assign(p.n, 0.0f);
  const double logprob =
      LossTermsReference(p, in.hidden, in.weight, in.targets, terms).per_token_logprob[0];

  // The roots of k3(d) = 10, and the float q on either side of each.
  double lower = -11.0, upper = 3.0;
  for (int i = 0; i < 8; ++i) lower = std::exp(lower) - 11.0;
  upper = loss::KlClampRoot();
  const float q_lower = static_cast<float>(logprob + lower);
  const float q_upper = static_cast<float>(logprob + upper);
  auto step = [](float q, float to) { return std::nextafter(q, to); };
  const float below_lower = q_lower - logprob > lower ? q_lower : step(q_lower, 0.0f);
  const float below_upper = q_upper - logprob < upper ? q_upper : step(q_upper, -100.0f);
  // q - log p per token: above the clamp (k3 about 28.6 and 12), below it (0.72 and 4.0), and
  // next to each root, inside and one float step of q outside. The clipped term is off (A = 0),
  // so that the KL term is each token's whole gradient.
  const float lp = static_cast<float>(logprob);
  terms.ref_logprob = {lp + 3.5f,   lp - 13.0f,
                       lp + 1.0f,   lp - 5.0f,
                       below_lower, step(below_lower, -100.0f),
                       below_upper, step(below_upper, 100.0f)};
  const bool clamped[] = {true, true, false, false, false, true, false, true};
  terms.old_logprob.assign(p.n, lp);
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, RunOptionsFor(terms, size_t{1} << 20));
  ASSERT_TRUE(out.ok()) << out.status();

  for (int64_t t = 0; t < p.n; ++t) {
    SCOPED_TRACE(::testing::Message() << "token " << t);
    ASSERT_EQ(ref.per_token_logprob[t], logprob);
    const double d = static_cast<double>(terms.ref_logprob[t]) - logprob;
    const double k3 = (std::exp(d) - 1.0) - d;
    ASSERT_EQ(k3 > loss::kKlClamp, clamped[t]) << k3;
    EXPECT_EQ(ref.per_token_loss[t], 0.5 * std::min(k3, loss::kKlClamp));
    EXPECT_NEAR(out->per_token_loss[t], ref.per_token_loss[t], 1e-6 * ref.per_token_loss[t]);
    // dH_t = sum_j dz_j w_j with dz = c ([j == 0] - p), c = dloss/dlog p: 0 where clamped.
    if (clamped[t]) {
      EXPECT_EQ(ref.grad_hidden[t], 0.0);
      EXPECT_EQ(out->grad_hidden[t], 0.0);
    } else {
      EXPECT_NE(ref.grad_hidden[t], 0.0);
      EXPECT_NEAR(out->grad_hidden[t], ref.grad_hidden[t], 1e-5 * std::abs(ref.grad_hidden[t]));
    }
  }
  EXPECT_LE(WorstToleranceRatio(ToDouble(out->grad_weight), ref.grad_weight, 1e-5,
                                1e-6 * MaxAbs(ref.grad_weight)),
            1.0);
}

// ---------------------------------------------------------------------------------------------
// Errors: the options in ValidateProblem, the inputs in Run, the shards' refusal.

TEST(LossTermsErrors, BadOptionsAreInvalidArgumentNamingTheField) {
  const Problem base{.n = 4, .d = 8, .v = 16, .dtype = DType::kFP32};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<std::function<void(LossOptions&)>, std::string>> bad = {
      {[](LossOptions& o) { o.logit_scale = 0.0f; }, "logit_scale"},
      {[](LossOptions& o) { o.logit_scale = -1.0f; }, "logit_scale"},
      {[&](LossOptions& o) { o.logit_scale = nan; }, "logit_scale"},
      {[&](LossOptions& o) { o.logit_scale = inf; }, "logit_scale"},
      {[&](LossOptions& o) { o.entropy_coef = nan; }, "entropy_coef"},
      {[&](LossOptions& o) { o.entropy_coef = -inf; }, "entropy_coef"},
      {[](LossOptions& o) { o.kind = static_cast<LossKind>(9); }, "kind"},
      {[](LossOptions& o) { o.clip_low = -0.1f; }, "clip_low"},
      {[](LossOptions& o) { o.clip_low = 1.5f; }, "clip_low"},
      {[&](LossOptions& o) { o.clip_low = nan; }, "clip_low"},
      {[](LossOptions& o) { o.clip_high = -0.1f; }, "clip_high"},
      {[&](LossOptions& o) { o.clip_high = inf; }, "clip_high"},
      {[](LossOptions& o) {
         o.kind = LossKind::kPolicyGradient;
         o.kl_coef = -0.1f;
       },
       "kl_coef"},
      {[&](LossOptions& o) {
         o.kind = LossKind::kPolicyGradient;
         o.kl_coef = nan;
       },
       "kl_coef"},
      {[](LossOptions& o) { o.kl_coef = 0.1f; }, "kl_coef"},  // cross-entropy has no KL term
      {[](LossOptions& o) {
         o.kind = LossKind::kPolicyGradient;
         o.label_smoothing = 0.1f;
       },
       "label_smoothing"}};
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  for (const auto& [set, field] : bad) {
    Problem p = base;
    set(p.options);
    const absl::Status status = ValidateProblem(p);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
    EXPECT_EQ(backend->WorkspaceBytes(p, size_t{1} << 20).status().code(),
              absl::StatusCode::kInvalidArgument)
        << field;
  }
  // The bounds themselves are valid.
  Problem p = base;
  p.options.kind = LossKind::kPolicyGradient;
  p.options.clip_low = 1.0f;
  p.options.clip_high = 0.0f;
  p.options.logit_scale = std::numeric_limits<float>::denorm_min();
  p.options.entropy_coef = -1e30f;
  EXPECT_TRUE(ValidateProblem(p).ok()) << ValidateProblem(p);
}

// One Run with poisoned outputs; what it returns, and whether anything was written.
struct ErrorRun {
  Problem problem{.n = 8, .d = 16, .v = 64, .dtype = DType::kFP32};
  Inputs in;
  std::vector<float> bias, weights, old_logprob, advantages, ref_logprob;
  std::vector<float> grad_bias, grad_weight, per_token_loss;
  float loss_sum = 7.0f;
  int64_t token_count = 7;
  bool use_bias = false, use_grad_bias = false, use_weights = false, use_old = false,
       use_advantages = false, use_ref = false;

  ErrorRun() {
    in = MakeRandomInputs(problem, 11);
    in.targets[5] = static_cast<int32_t>(problem.options.ignore_index);
    bias.assign(problem.v, 0.1f);
    weights.assign(problem.n, 1.0f);
    old_logprob.assign(problem.n, -3.0f);
    advantages.assign(problem.n, 0.5f);
    ref_logprob.assign(problem.n, -3.0f);
  }

  absl::Status Run() {
    grad_bias.assign(problem.v, 7.0f);
    grad_weight.assign(problem.v * problem.d, 7.0f);
    per_token_loss.assign(problem.n, 7.0f);
    loss_sum = 7.0f;
    token_count = 7;
    std::unique_ptr<Backend> backend = CreateCpuBackend(1);
    absl::StatusOr<size_t> bytes = backend->WorkspaceBytes(problem, size_t{1} << 20);
    if (!bytes.ok()) return bytes.status();
    std::vector<char> workspace(*bytes);
    Arguments args;
    args.hidden = in.hidden_bytes.data();
    args.weight = in.weight_bytes.data();
    args.targets = in.targets.data();
    args.grad_weight = grad_weight.data();
    args.loss_sum = &loss_sum;
    args.token_count = &token_count;
    args.per_token_loss = per_token_loss.data();
    args.bias = use_bias ? bias.data() : nullptr;
    args.grad_bias = use_grad_bias ? grad_bias.data() : nullptr;
    args.token_weights = use_weights ? weights.data() : nullptr;
    args.old_logprob = use_old ? old_logprob.data() : nullptr;
    args.advantages = use_advantages ? advantages.data() : nullptr;
    args.ref_logprob = use_ref ? ref_logprob.data() : nullptr;
    args.workspace = workspace.data();
    args.workspace_bytes = workspace.size();
    auto stream = backend->CreateStream();
    if (!stream.ok()) return stream.status();
    return backend->Run(problem, args, **stream);
  }

  bool Untouched() const {
    return loss_sum == 7.0f && token_count == 7 &&
           grad_bias == std::vector<float>(problem.v, 7.0f) &&
           grad_weight == std::vector<float>(problem.v * problem.d, 7.0f) &&
           per_token_loss == std::vector<float>(problem.n, 7.0f);
  }
};

void ExpectRefused(ErrorRun& run, const std::string& message) {
  const absl::Status status = run.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(message), std::string::npos) << status;
  EXPECT_TRUE(run.Untouched());
}

TEST(LossTermsErrors, InconsistentInputsAreInvalidArgumentAndWriteNothing) {
  {
    ErrorRun run;
    run.use_grad_bias = true;
    ExpectRefused(run, "grad_bias is given without bias");
  }
  {
    ErrorRun run;
    run.problem.options.kind = LossKind::kPolicyGradient;
    run.use_old = true;
    ExpectRefused(run, "kind policy_gradient needs old_logprob and advantages");
  }
  {
    ErrorRun run;
    run.use_old = run.use_advantages = true;  // cross-entropy
    ExpectRefused(run, "old_logprob and advantages apply to kind policy_gradient only");
  }
  {
    ErrorRun run;
    run.problem.options.kind = LossKind::kPolicyGradient;
    run.problem.options.kl_coef = 0.1f;
    run.use_old = run.use_advantages = true;
    ExpectRefused(run, "kl_coef > 0 needs ref_logprob");
  }
  {
    ErrorRun run;
    run.problem.options.kind = LossKind::kPolicyGradient;
    run.use_old = run.use_advantages = run.use_ref = true;
    ExpectRefused(run, "ref_logprob is given but kl_coef is 0");
  }
}

TEST(LossTermsErrors, NonFiniteInputsAreInvalidArgumentNamingFieldAndIndex) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  {
    ErrorRun run;
    run.use_bias = run.use_grad_bias = true;
    run.bias[40] = -inf;
    ExpectRefused(run, "bias[40] must be finite");
  }
  {
    ErrorRun run;
    run.use_weights = true;
    run.weights[3] = nan;
    ExpectRefused(run, "token_weights[3] must be finite");
  }
  {
    ErrorRun run;
    run.problem.options.kind = LossKind::kPolicyGradient;
    run.problem.options.kl_coef = 0.1f;
    run.use_old = run.use_advantages = run.use_ref = true;
    run.old_logprob[0] = -inf;
    ExpectRefused(run, "old_logprob[0] must be finite");
    run.old_logprob[0] = -1.0f;
    run.advantages[7] = nan;
    ExpectRefused(run, "advantages[7] must be finite");
    run.advantages[7] = 1.0f;
    run.ref_logprob[1] = inf;
    ExpectRefused(run, "ref_logprob[1] must be finite");
    // An ignored token's inputs are not read, so not checked.
    run.ref_logprob[1] = -1.0f;
    run.old_logprob[5] = run.advantages[5] = run.ref_logprob[5] = nan;
    EXPECT_TRUE(run.Run().ok());
    EXPECT_FALSE(run.Untouched());
    EXPECT_EQ(run.per_token_loss[5], 0.0f);
  }
  {
    ErrorRun run;
    run.use_weights = true;
    run.weights[5] = nan;  // token 5 is ignored
    EXPECT_TRUE(run.Run().ok());
    EXPECT_TRUE(std::isfinite(run.loss_sum));
  }
}

TEST(LossTermsErrors, RequestedAreNamedInFieldOrder) {
  LossOptions options;
  EXPECT_EQ(RequestedLossTerms(options), "");
  options.kind = LossKind::kPolicyGradient;
  options.logit_scale = 2.0f;
  EXPECT_EQ(RequestedLossTerms(options), "logit_scale, kind=policy_gradient");
  options.entropy_coef = 0.1f;
  EXPECT_EQ(RequestedLossTerms(options), "logit_scale, entropy_coef, kind=policy_gradient");

  Arguments args;
  EXPECT_FALSE(AsksLossInputs(args));
  EXPECT_EQ(RequestedLossInputs(args), "");
  float f = 0.0f;
  args.advantages = &f;
  EXPECT_TRUE(AsksLossInputs(args));
  EXPECT_EQ(RequestedLossInputs(args), "advantages");
  args.bias = args.token_weights = args.old_logprob = args.ref_logprob = &f;
  args.grad_bias = &f;
  EXPECT_EQ(RequestedLossInputs(args),
            "bias, grad_bias, token_weights, old_logprob, advantages, ref_logprob");
}

// The shards compute the terms (cpu_shard_terms_test.cc) and check their inputs as Run does:
// inconsistent pointers are INVALID_ARGUMENT naming the field in every call that takes them, the
// entropy term without output_stats too; a non-finite value in ShardBegin, before it writes.
TEST(LossTermsErrors, ShardCallsCheckTheInputs) {
  ShardProblem shard;
  shard.problem = Problem{.n = 4, .d = 8, .v = 16, .dtype = DType::kFP32};
  shard.rows = 8;
  shard.shards = 2;
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  absl::StatusOr<ShardPlan> plan = backend->PlanShard(shard, size_t{1} << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<float> hidden(4 * 8, 0.5f), weight(8 * 8, 0.25f), bias(8, 0.0f), w(4, 1.0f);
  std::vector<int32_t> targets = {0, 3, 9, 15};
  std::vector<float> stats(plan->stats_floats);
  std::vector<char> workspace(plan->workspace_bytes);
  ShardArguments args;
  args.hidden = hidden.data();
  args.weight = weight.data();
  args.targets = targets.data();
  args.stats = stats.data();
  args.stats_chunk_rows = plan->chunk_rows;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.size();
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  const ShardChunk chunk{0, 4};
  auto expect_invalid = [&](const ShardProblem& s, const ShardArguments& a,
                            const std::string& field) {
    for (absl::Status status :
         {backend->ShardBegin(s, a, **stream), backend->ShardForward(s, a, chunk, **stream),
          backend->ShardBackward(s, a, chunk, **stream)}) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find(field), std::string::npos) << status;
    }
  };
  for (const auto& [set, name] :
       std::vector<std::pair<std::function<void(LossOptions&)>, std::string>>{
           {[](LossOptions& o) { o.logit_scale = 0.5f; }, ""},
           {[](LossOptions& o) { o.entropy_coef = 0.1f; }, "output_stats"},
           {[](LossOptions& o) { o.kind = LossKind::kPolicyGradient; }, "old_logprob"}}) {
    ShardProblem s = shard;
    set(s.problem.options);
    EXPECT_TRUE(backend->PlanShard(s, size_t{1} << 20).ok());
    if (name.empty()) {
      EXPECT_TRUE(backend->ShardBegin(s, args, **stream).ok());
    } else {
      expect_invalid(s, args, name);
    }
  }
  ShardArguments grad_bias_alone = args;
  grad_bias_alone.grad_bias = bias.data();
  expect_invalid(shard, grad_bias_alone, "grad_bias");
  ShardArguments with = args;
  with.bias = bias.data();
  with.token_weights = w.data();
  EXPECT_TRUE(backend->ShardBegin(shard, with, **stream).ok());
  // A non-finite bias entry: refused before the token count is written.
  int64_t count = -7;
  with.token_count = &count;
  bias[5] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status nan = backend->ShardBegin(shard, with, **stream);
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument) << nan;
  EXPECT_NE(nan.message().find("bias[5]"), std::string::npos) << nan;
  EXPECT_EQ(count, -7);
}

}  // namespace
}  // namespace losshead::kernels
