// The model options and loss terms beyond the plain loss (problem.h) over vocabulary shards on the
// CPU backend (shard_problem.h): 1 to 4 shards, whole and chunked micro-batches, each term alone
// and with the others, against the CPU backend's one-device Run and the float64 reference
// (loss_terms_reference.h); the shards' bias and grad_bias are their rows of the whole one.
//
// Tolerances: the shards form each token's lse and loss from per-shard statistics in double, and G
// from exp(z - lse) rather than exp(z - max) / sum_exp: the values agree with the one-device Run
// to 1e-5 relative (plus 1e-6 of the largest), G to a few fp32 ulps, so dH to one ulp of the
// problem's dtype and dW, db (fp32 sums) to 1e-5 relative plus 1e-5 of the largest. Against
// float64 as cpu_loss_terms_test.cc compares the one-device Run.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/loss_terms_reference.h"
#include "tests/kernels/shard_runner.h"
#include "tests/kernels/term_checks.h"

namespace losshead::kernels {
namespace {

using testing::ExpectWithin;
using testing::Inputs;
using testing::InputSpec;
using testing::LossTermsReference;
using testing::MakeRandomInputs;
using testing::MaxAbs;
using testing::Outputs;
using testing::RandomTermInputs;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::TermInputs;
using testing::TermResult;
using testing::ToDouble;

constexpr size_t kWhole = size_t{64} << 20;

using testing::CrossEntropy;
using testing::PolicyGradient;
using testing::With;

struct Case {
  std::string name;
  int shards;
  DType dtype;
  LossOptions options;
  bool bias = false;
  bool weights = false;
  bool chunked = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

double UlpOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 0x1p-7;
    case DType::kFP16:
      return 0x1p-10;
    case DType::kFP32:
      return 1e-5;
  }
  return 0.0;
}

class CpuShardTermsTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuShardTermsTest, MatchesTheWholeRunAndFloat64) {
  const Case& c = GetParam();
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> shards;
  for (int r = 0; r < c.shards; ++r) {
    owned.push_back(CreateCpuBackend(2));
    shards.push_back(owned.back().get());
  }
  // V not divisible by 2, 3 or 4; N over several chunks of the small budget.
  const Problem p{.n = 61, .d = 24, .v = 203, .dtype = c.dtype, .options = c.options};
  const uint64_t seed = std::hash<std::string>()(c.name);
  const Inputs in = MakeRandomInputs(
      p, seed, InputSpec{.hidden_scale = 1.0, .weight_scale = 0.7, .ignore_fraction = 0.25});
  const TermInputs terms =
      RandomTermInputs(p, in.hidden, in.weight, in.targets, c.bias, c.weights, seed + 1, 0.02f);
  RunOptions run = testing::WithTermInputs(RunOptions{}, terms);
  // The accumulators start from something, to see += rather than =.
  run.initial_grad_weight.assign(p.v * p.d, 0.25f);
  if (c.bias) run.initial_grad_bias.assign(p.v, -0.5f);
  if (c.chunked) {
    // The smallest budget (in steps of 4 KiB) that every shard plans for: a few tokens a chunk.
    const ShardProblem first{
        .problem = p, .rows = ShardRange(p.v, c.shards, 0).size(), .shards = c.shards};
    run.workspace_budget = 4096;
    absl::StatusOr<ShardPlan> plan = shards[0]->PlanShard(first, run.workspace_budget);
    while (!plan.ok() && run.workspace_budget < kWhole) {
      run.workspace_budget += 4096;
      plan = shards[0]->PlanShard(first, run.workspace_budget);
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_LT(plan->chunk_rows, p.n / 4) << "the budget should split the micro-batch";
  }

  absl::StatusOr<Outputs> sharded = RunSharded(shards, nullptr, in, run);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  RunOptions whole_run = run;
  whole_run.workspace_budget = kWhole;
  absl::StatusOr<Outputs> whole = RunOnBackend(*shards[0], in, whole_run);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);

  EXPECT_EQ(sharded->token_count, whole->token_count);
  EXPECT_EQ(sharded->token_count, ref.token_count);
  {
    SCOPED_TRACE("shards against the one-device Run");
    EXPECT_NEAR(sharded->loss_sum, whole->loss_sum, 1e-5 * (1.0 + std::abs(whole->loss_sum)));
    const std::vector<double> loss = ToDouble(whole->per_token_loss);
    ExpectWithin(ToDouble(sharded->per_token_loss), loss, 1e-5, 1e-6 * MaxAbs(loss),
                 "per_token_loss");
    ExpectWithin(ToDouble(sharded->per_token_lse), ToDouble(whole->per_token_lse), 1e-6, 0.0,
                 "per_token_lse");
    ExpectWithin(sharded->grad_hidden, whole->grad_hidden, UlpOf(c.dtype),
                 1e-6 * MaxAbs(whole->grad_hidden), "grad_hidden");
    const std::vector<double> dw = ToDouble(whole->grad_weight);
    ExpectWithin(ToDouble(sharded->grad_weight), dw, 1e-5, 1e-5 * MaxAbs(dw), "grad_weight");
    if (c.bias) {
      const std::vector<double> db = ToDouble(whole->grad_bias);
      ExpectWithin(ToDouble(sharded->grad_bias), db, 1e-5, 1e-5 * MaxAbs(db), "grad_bias");
    }
  }
  {
    SCOPED_TRACE("shards against float64");
    EXPECT_NEAR(sharded->loss_sum, ref.loss_sum, 1e-5 * (1.0 + std::abs(ref.loss_sum)));
    ExpectWithin(ToDouble(sharded->per_token_loss), ref.per_token_loss, 1e-5,
                 1e-6 * MaxAbs(ref.per_token_loss), "per_token_loss");
    ExpectWithin(sharded->grad_hidden, ref.grad_hidden, UlpOf(c.dtype),
                 1e-5 * MaxAbs(ref.grad_hidden), "grad_hidden");
    std::vector<double> dw = ref.grad_weight;
    for (double& x : dw) x += 0.25;
    ExpectWithin(ToDouble(sharded->grad_weight), dw, 1e-5, 1e-5 * MaxAbs(ref.grad_weight),
                 "grad_weight");
    if (c.bias) {
      std::vector<double> db = ref.grad_bias;
      for (double& x : db) x -= 0.5;
      ExpectWithin(ToDouble(sharded->grad_bias), db, 1e-5, 1e-5 * MaxAbs(ref.grad_bias),
                   "grad_bias");
    }
  }
  // Ignored tokens: no loss, no gradient.
  for (int64_t t = 0; t < p.n; ++t) {
    if (in.targets[t] != p.options.ignore_index) continue;
    EXPECT_EQ(sharded->per_token_loss[t], 0.0f) << "token " << t;
  }
}

std::vector<Case> Cases() {
  const testing::ShardTermOptions sets;
  const LossOptions &scale = sets.scale, &entropy = sets.entropy, &policy = sets.policy;
  const LossOptions &everything_ce = sets.everything_ce, &everything_pg = sets.everything_pg;
  std::vector<Case> cases;
  for (int k = 1; k <= 4; ++k) {
    const std::string s = std::to_string(k) + "Shards";
    cases.push_back({s + "_FP32_Scale", k, DType::kFP32, scale});
    cases.push_back({s + "_BF16_Bias_Chunked", k, DType::kBF16, CrossEntropy(), true, false, true});
    cases.push_back(
        {s + "_FP16_Weights", k, DType::kFP16,
         With(CrossEntropy(Reduction::kNone), [](LossOptions& o) { o.label_smoothing = 0.1f; }),
         false, true});
    cases.push_back({s + "_FP32_Entropy_Softcap_ZLoss", k, DType::kFP32, entropy});
    cases.push_back({s + "_FP32_PolicyGradient_Kl", k, DType::kFP32, policy});
    cases.push_back({s + "_BF16_CrossEntropy_Everything_Chunked", k, DType::kBF16, everything_ce,
                     true, true, true});
    cases.push_back({s + "_FP32_PolicyGradient_Everything_Chunked", k, DType::kFP32, everything_pg,
                     true, true, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Terms, CpuShardTermsTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace losshead::kernels
