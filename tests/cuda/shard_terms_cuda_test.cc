// The model options and loss terms beyond the plain loss (problem.h: logit scale, bias and its
// gradient, per-token weights, the entropy term, the policy-gradient loss with its KL term) over
// vocabulary shards on the CUDA backend (shard_problem.h): 1, 2 and 3 shards on one GPU, each
// term alone and with the others, whole and chunked micro-batches, deferred dW, with and without
// the distribution outputs beside them; against the CPU backend's shards of the same head (checked
// against the one-device Run and float64 in tests/kernels/cpu_shard_terms_test.cc) and the float64
// reference (loss_terms_reference.h); reruns give the same bits. Bad term inputs are refused as on
// the CPU backend. The statistics and dH partials are exchanged through the host (shard_runner.h).
//
// Tolerances as tests/cuda/cuda_loss_terms_test.cc's for the one-device Run (the shards combine
// the same statistics in double): values within 1e-3 relative plus 1e-4 of the largest; gradients
// (G rounded to the problem's dtype before the GEMMs) within four of its unit roundoffs relative
// plus 2e-3 (fp32: 1e-4) of the largest; with bf16 logits 3e-2 and 2e-2 of the largest.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/cuda/cuda_testing.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/distribution_checks.h"
#include "tests/kernels/grad_stash_runner.h"
#include "tests/kernels/loss_terms_reference.h"
#include "tests/kernels/shard_runner.h"
#include "tests/kernels/term_checks.h"

namespace losshead::kernels {
namespace {

using testing::CrossEntropy;
using testing::ExpectWithinShare;
using testing::Inputs;
using testing::InputSpec;
using testing::LossTermsReference;
using testing::MakeCuda;
using testing::MakeRandomInputs;
using testing::MaxAbs;
using testing::Outputs;
using testing::PolicyGradient;
using testing::RandomTermInputs;
using testing::RunOptions;
using testing::RunSharded;
using testing::SameFloatBits;
using testing::TermInputs;
using testing::TermResult;
using testing::ToDouble;
using testing::With;
using testing::WithTermInputs;

constexpr size_t kMiB = size_t{1} << 20;

struct Case {
  std::string name;
  int shards = 2;
  DType dtype = DType::kFP32;
  LossOptions options;
  bool bias = false;     // bias and grad_bias
  bool weights = false;  // token_weights
  bool outputs = false;  // logprob and entropy beside the terms
  bool chunked = false;  // a budget of a few dozen tokens a chunk
  bool stash = false;    // deferred dW (ShardArguments::grad_stash)
  bool bf16_logits = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// N over several chunks of the small budget; V not divisible by 2 or 3.
constexpr int64_t kN = 97, kD = 64, kV = 1003;

testing::TermTolerance ToleranceFor(const Case& c) {
  return testing::CudaTermTolerance(c.dtype, c.bf16_logits);
}

// A budget that gives chunks of about 40 tokens on the widest shard (as shard_cuda_test.cc's
// BudgetFor): the logits row, its row loss, the statistics and the dH partial.
size_t BudgetFor(const Case& c, const CudaBackendOptions& o) {
  if (!c.chunked) return 64 * kMiB;
  const int64_t widest = (kV + c.shards - 1) / c.shards;
  const size_t logits_elem = c.bf16_logits && c.dtype == DType::kBF16 ? 2 : 4;
  const size_t per_row = logits_elem * ((widest + 15) / 16 * 16) + 4 * (1 + 4 * c.shards + kD);
  return o.cublas_workspace_bytes + o.handle_reserve_bytes + 4096 + 40 * per_row;
}

std::vector<std::unique_ptr<Backend>> CudaShards(int k, const CudaBackendOptions& o) {
  std::vector<std::unique_ptr<Backend>> owned;
  for (int r = 0; r < k; ++r) owned.push_back(MakeCuda(o));
  return owned;
}

std::vector<Backend*> Pointers(const std::vector<std::unique_ptr<Backend>>& owned) {
  std::vector<Backend*> out;
  for (const auto& b : owned) out.push_back(b.get());
  return out;
}

// The sharded run of `run` on `shards`, with deferred dW when `stash` (dW then the flushed stash
// plus the run's starting dW, as RunSharded's would be).
absl::StatusOr<Outputs> RunShards(const std::vector<Backend*>& shards, const Inputs& in,
                                  const RunOptions& run, bool stash) {
  if (!stash) return RunSharded(shards, nullptr, in, run);
  absl::StatusOr<testing::StashedRun> stashed =
      testing::RunShardedStashed(shards, {in}, in.problem.n, run.workspace_budget, &run);
  if (!stashed.ok()) return stashed.status();
  Outputs out = stashed->microbatches[0];
  out.grad_weight = stashed->grad_weight;
  for (size_t i = 0; i < out.grad_weight.size() && i < run.initial_grad_weight.size(); ++i) {
    out.grad_weight[i] += run.initial_grad_weight[i];
  }
  return out;
}

class CudaShardTermsTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaShardTermsTest, MatchesTheCpuShardsAndFloat64) {
  SKIP_WITHOUT_GPU();
  const Case& c = GetParam();
  const Problem p{.n = kN, .d = kD, .v = kV, .dtype = c.dtype, .options = c.options};
  const uint64_t seed = std::hash<std::string>()(c.name);
  const Inputs in = MakeRandomInputs(
      p, seed, InputSpec{.hidden_scale = 1.0, .weight_scale = 0.6, .ignore_fraction = 0.2});
  // Never within 0.05 of the clip's kinks: CUDA's log p is a few ulps (bf16 logits: a bf16 step)
  // from the CPU's.
  const TermInputs terms =
      RandomTermInputs(p, in.hidden, in.weight, in.targets, c.bias, c.weights, seed + 1, 0.05f);
  CudaBackendOptions o;
  o.bf16_logits = c.bf16_logits;
  std::vector<std::unique_ptr<Backend>> cuda = CudaShards(c.shards, o);
  for (const auto& b : cuda) ASSERT_NE(b, nullptr);
  const std::vector<Backend*> shards = Pointers(cuda);

  RunOptions run;
  run.workspace_budget = BudgetFor(c, o);
  run.logprob = run.entropy = c.outputs;
  run = WithTermInputs(run, terms);
  // The accumulators start from something, to see += rather than =.
  run.initial_grad_weight.assign(p.v * p.d, 0.25f);
  if (c.bias) run.initial_grad_bias.assign(p.v, -0.5f);
  if (c.chunked) {
    const ShardProblem first{
        .problem = p, .rows = ShardRange(p.v, c.shards, 0).size(), .shards = c.shards};
    absl::StatusOr<ShardPlan> plan = shards[0]->PlanShard(first, run.workspace_budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_LT(plan->chunk_rows, p.n) << "the budget should split the micro-batch";
  }
  absl::StatusOr<Outputs> got = RunShards(shards, in, run, c.stash);
  ASSERT_TRUE(got.ok()) << got.status();

  std::vector<std::unique_ptr<Backend>> cpu;
  for (int r = 0; r < c.shards; ++r) cpu.push_back(CreateCpuBackend(2));
  RunOptions cpu_run = run;
  cpu_run.workspace_budget = 64 * kMiB;
  absl::StatusOr<Outputs> want = RunSharded(Pointers(cpu), nullptr, in, cpu_run);
  ASSERT_TRUE(want.ok()) << want.status();
  const TermResult ref = LossTermsReference(p, in.hidden, in.weight, in.targets, terms);

  const testing::TermTolerance tol = ToleranceFor(c);
  EXPECT_EQ(got->token_count, want->token_count);
  EXPECT_EQ(got->token_count, ref.token_count);
  {
    SCOPED_TRACE("CUDA shards against the CPU shards");
    EXPECT_NEAR(got->loss_sum, want->loss_sum,
                tol.value_rel * std::abs(want->loss_sum) +
                    tol.value_abs * MaxAbs(ToDouble(want->per_token_loss)) * p.n);
    ExpectWithinShare(ToDouble(got->per_token_loss), ToDouble(want->per_token_loss), tol.value_rel,
                      tol.value_abs, "per_token_loss");
    ExpectWithinShare(ToDouble(got->per_token_lse), ToDouble(want->per_token_lse), tol.value_rel,
                      tol.value_abs, "per_token_lse");
    if (c.outputs) {
      ExpectWithinShare(ToDouble(got->per_token_logprob), ToDouble(want->per_token_logprob),
                        tol.value_rel, tol.value_abs, "per_token_logprob");
      ExpectWithinShare(ToDouble(got->per_token_entropy), ToDouble(want->per_token_entropy),
                        tol.value_rel, tol.value_abs, "per_token_entropy");
    }
    ExpectWithinShare(got->grad_hidden, want->grad_hidden, tol.grad_rel, tol.grad_abs,
                      "grad_hidden");
    ExpectWithinShare(ToDouble(got->grad_weight), ToDouble(want->grad_weight), tol.grad_rel,
                      tol.grad_abs, "grad_weight");
    if (c.bias) {
      ExpectWithinShare(ToDouble(got->grad_bias), ToDouble(want->grad_bias), tol.grad_rel,
                        tol.grad_abs, "grad_bias");
    }
  }
  {
    SCOPED_TRACE("CUDA shards against float64");
    EXPECT_NEAR(
        got->loss_sum, ref.loss_sum,
        tol.value_rel * std::abs(ref.loss_sum) + tol.value_abs * MaxAbs(ref.per_token_loss) * p.n);
    ExpectWithinShare(ToDouble(got->per_token_loss), ref.per_token_loss, tol.value_rel,
                      tol.value_abs, "per_token_loss");
    ExpectWithinShare(ToDouble(got->per_token_lse), ref.per_token_lse, tol.value_rel, tol.value_abs,
                      "per_token_lse");
    if (c.outputs) {
      ExpectWithinShare(ToDouble(got->per_token_logprob), ref.per_token_logprob, tol.value_rel,
                        tol.value_abs, "per_token_logprob");
      ExpectWithinShare(ToDouble(got->per_token_entropy), ref.per_token_entropy, tol.value_rel,
                        tol.value_abs, "per_token_entropy");
    }
    ExpectWithinShare(got->grad_hidden, ref.grad_hidden, tol.grad_rel, tol.grad_abs, "grad_hidden");
    // What the call added to dW and db: the starting values would hide a wrong gradient.
    std::vector<double> dw = ToDouble(got->grad_weight);
    for (double& x : dw) x -= 0.25;
    ExpectWithinShare(dw, ref.grad_weight, tol.grad_rel, tol.grad_abs, "grad_weight");
    if (c.bias) {
      std::vector<double> db = ToDouble(got->grad_bias);
      for (double& x : db) x += 0.5;
      ExpectWithinShare(db, ref.grad_bias, tol.grad_rel, tol.grad_abs, "grad_bias");
      EXPECT_GT(MaxAbs(ref.grad_bias), 0.0);
    }
  }
  // Ignored tokens: no loss, no gradient.
  for (int64_t t = 0; t < p.n; ++t) {
    if (in.targets[t] != p.options.ignore_index) continue;
    EXPECT_EQ(got->per_token_loss[t], 0.0f) << "token " << t;
    for (int64_t k = 0; k < p.d; ++k) ASSERT_EQ(got->grad_hidden[t * p.d + k], 0.0) << t;
  }
  // A rerun gives the same bits, grad_bias's column sums included.
  absl::StatusOr<Outputs> again = RunShards(shards, in, run, c.stash);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(SameFloatBits(again->per_token_loss, got->per_token_loss));
  EXPECT_TRUE(SameFloatBits(again->grad_weight, got->grad_weight));
  EXPECT_TRUE(SameFloatBits(again->grad_bias, got->grad_bias));
  EXPECT_EQ(again->grad_hidden, got->grad_hidden);
}

std::vector<Case> Cases() {
  const testing::ShardTermOptions sets;
  const LossOptions &scale = sets.scale, &entropy = sets.entropy, &policy = sets.policy;
  const LossOptions &everything_ce = sets.everything_ce, &everything_pg = sets.everything_pg;
  std::vector<Case> cases;
  for (int k = 1; k <= 3; ++k) {
    const std::string s = std::to_string(k) + "Shards";
    cases.push_back({.name = s + "_FP32_Scale", .shards = k, .options = scale});
    cases.push_back({.name = s + "_BF16_Bias_Chunked",
                     .shards = k,
                     .dtype = DType::kBF16,
                     .options = CrossEntropy(),
                     .bias = true,
                     .chunked = true});
    cases.push_back({.name = s + "_FP16_Weights_LabelSmoothing",
                     .shards = k,
                     .dtype = DType::kFP16,
                     .options = With(CrossEntropy(Reduction::kNone),
                                     [](LossOptions& o) { o.label_smoothing = 0.1f; }),
                     .weights = true});
    cases.push_back({.name = s + "_FP32_Entropy_Softcap_ZLoss", .shards = k, .options = entropy});
    cases.push_back({.name = s + "_FP32_PolicyGradient_Kl", .shards = k, .options = policy});
    cases.push_back({.name = s + "_BF16_PolicyGradient_Kl_Outputs",
                     .shards = k,
                     .dtype = DType::kBF16,
                     .options = policy,
                     .outputs = true});
    cases.push_back({.name = s + "_BF16_CrossEntropy_Everything_Chunked",
                     .shards = k,
                     .dtype = DType::kBF16,
                     .options = everything_ce,
                     .bias = true,
                     .weights = true,
                     .chunked = true});
    cases.push_back({.name = s + "_FP32_PolicyGradient_Everything_Outputs_Chunked",
                     .shards = k,
                     .options = everything_pg,
                     .bias = true,
                     .weights = true,
                     .outputs = true,
                     .chunked = true});
    cases.push_back({.name = s + "_BF16_CrossEntropy_Everything_Stash",
                     .shards = k,
                     .dtype = DType::kBF16,
                     .options = everything_ce,
                     .bias = true,
                     .weights = true,
                     .stash = true});
    cases.push_back({.name = s + "_FP16_PolicyGradient_Everything_Outputs",
                     .shards = k,
                     .dtype = DType::kFP16,
                     .options = everything_pg,
                     .bias = true,
                     .weights = true,
                     .outputs = true});
    cases.push_back({.name = s + "_BF16_CrossEntropy_Everything_Bf16Logits_Outputs",
                     .shards = k,
                     .dtype = DType::kBF16,
                     .options = everything_ce,
                     .bias = true,
                     .weights = true,
                     .outputs = true,
                     .bf16_logits = true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Terms, CudaShardTermsTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// With neutral inputs (a zero bias, unit weights) and no term of the options on, the terms'
// instantiations compute what the plain ones do: the loss and lse bit for bit (both combine the
// same statistics in double), dH and dW within the rounding of G (the terms fold their factors in
// double, as the CPU backend's shards do; the plain kernel forms them in fp32).
TEST(CudaShardTermsBits, NeutralInputsGiveThePlainKernelsBits) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Problem p{.n = 70,
                    .d = 48,
                    .v = 517,
                    .dtype = dtype,
                    .options = LossOptions{.label_smoothing = 0.1f, .z_loss = 1e-3f}};
    const Inputs in =
        MakeRandomInputs(p, 23, InputSpec{.weight_scale = 0.6, .ignore_fraction = 0.2});
    std::vector<std::unique_ptr<Backend>> cuda = CudaShards(3, {});
    for (const auto& b : cuda) ASSERT_NE(b, nullptr);
    absl::StatusOr<Outputs> want = RunSharded(Pointers(cuda), nullptr, in, RunOptions{});
    ASSERT_TRUE(want.ok()) << want.status();
    RunOptions neutral;
    neutral.bias.assign(p.v, 0.0f);
    neutral.grad_bias = true;
    neutral.token_weights.assign(p.n, 1.0f);
    absl::StatusOr<Outputs> got = RunSharded(Pointers(cuda), nullptr, in, neutral);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->loss_sum, want->loss_sum);
    EXPECT_TRUE(SameFloatBits(got->per_token_loss, want->per_token_loss));
    EXPECT_TRUE(SameFloatBits(got->per_token_lse, want->per_token_lse));
    const double rel = std::max(4 * testing::UnitRoundoff(dtype), 1e-5);
    ExpectWithinShare(got->grad_hidden, want->grad_hidden, rel, 1e-5, "grad_hidden");
    ExpectWithinShare(ToDouble(got->grad_weight), ToDouble(want->grad_weight), rel, 1e-5,
                      "grad_weight");
  }
}

// Inconsistent term inputs are refused before anything is launched, with the CPU backend's
// codes: INVALID_ARGUMENT naming the field, on every call of the sequence.
TEST(CudaShardTermsErrors, InconsistentInputsAreInvalidArgument) {
  SKIP_WITHOUT_GPU();
  const Problem p{.n = 8, .d = 16, .v = 64, .dtype = DType::kFP32};
  const Inputs in = MakeRandomInputs(p, 3);
  std::vector<std::unique_ptr<Backend>> cuda = CudaShards(2, {});
  for (const auto& b : cuda) ASSERT_NE(b, nullptr);
  std::vector<std::unique_ptr<Backend>> cpu;
  for (int r = 0; r < 2; ++r) cpu.push_back(CreateCpuBackend(1));
  struct Bad {
    const char* field;
    Problem problem;
    RunOptions run;
  };
  std::vector<Bad> bad;
  bad.push_back({"grad_bias", p, RunOptions{.grad_bias = true}});
  {
    RunOptions run;
    run.advantages.assign(p.n, 1.0f);
    bad.push_back({"advantages", p, run});
  }
  {
    // The policy gradient without its inputs.
    Problem pg = p;
    pg.options = PolicyGradient();
    bad.push_back({"old_logprob", pg, RunOptions{}});
  }
  {
    // ref_logprob without kl_coef > 0.
    Problem pg = p;
    pg.options = PolicyGradient();
    RunOptions run;
    run.old_logprob.assign(p.n, -1.0f);
    run.advantages.assign(p.n, 1.0f);
    run.ref_logprob.assign(p.n, -1.0f);
    bad.push_back({"ref_logprob", pg, run});
  }
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.field);
    Inputs with = in;
    with.problem = b.problem;
    for (auto* backends : {&cuda, &cpu}) {
      absl::StatusOr<Outputs> r = RunSharded(Pointers(*backends), nullptr, with, b.run);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_NE(r.status().message().find(b.field), std::string::npos) << r.status();
    }
  }
}

// The entropy term combines s over the shards, which travels in output_stats: a call without them
// is INVALID_ARGUMENT on every call, before anything is launched, as on the CPU backend.
TEST(CudaShardTermsErrors, EntropyTermNeedsOutputStats) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  Problem p{.n = 8, .d = 16, .v = 64, .dtype = DType::kFP32};
  p.options.entropy_coef = 0.1f;
  const Shard rows = ShardRange(p.v, 2, 0);
  const ShardProblem shard{
      .problem = p, .row_begin = rows.begin, .rows = rows.size(), .shards = 2, .rank = 0};
  for (Backend* b : {cuda.get(), cpu.get()}) {
    SCOPED_TRACE(b->name());
    absl::StatusOr<ShardPlan> plan = b->PlanShard(shard, 64 * kMiB);
    ASSERT_TRUE(plan.ok()) << plan.status();
    absl::StatusOr<std::unique_ptr<Stream>> stream = b->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::StatusOr<DeviceBuffer> hidden = b->Allocate(p.n * p.d * 4),
                                 weight = b->Allocate(shard.rows * p.d * 4),
                                 targets = b->Allocate(p.n * 4),
                                 stats = b->Allocate(plan->stats_floats * 4),
                                 workspace = b->Allocate(plan->workspace_bytes);
    for (const auto* buffer : {&hidden, &weight, &targets, &stats, &workspace}) {
      ASSERT_TRUE(buffer->ok()) << buffer->status();
    }
    const std::vector<int32_t> t(p.n, 3);
    ASSERT_TRUE(b->CopyToDevice(targets->data(), t.data(), p.n * 4, **stream).ok());
    ShardArguments args;
    args.hidden = hidden->data();
    args.weight = weight->data();
    args.targets = targets->as<int32_t>();
    args.stats = stats->as<float>();
    args.stats_chunk_rows = plan->chunk_rows;
    args.workspace = workspace->data();
    args.workspace_bytes = plan->workspace_bytes;
    const ShardChunk chunk{0, p.n};
    for (const absl::Status& s :
         {b->ShardBegin(shard, args, **stream), b->ShardForward(shard, args, chunk, **stream),
          b->ShardBackward(shard, args, chunk, **stream)}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("entropy_coef"), std::string::npos) << s;
    }
  }
}

}  // namespace
}  // namespace losshead::kernels
