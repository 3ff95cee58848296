// The CPU backend's vocabulary-shard entry points: k shards against the float64 reference and the
// unsharded Run on fresh random inputs, exchanged through the host collective and through the
// host directly, and the shard calls' errors.
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/collective.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/reference_loss.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

using testing::Inputs;
using testing::InputSpec;
using testing::MakeRandomInputs;
using testing::MaxAbs;
using testing::Outputs;
using testing::ReferenceLoss;
using testing::ReferenceResult;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::ToDouble;
using testing::WorstToleranceRatio;

struct Case {
  int shards;
  DType dtype;
  Reduction reduction;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;
  double ignore_fraction = 0.0;
};

class CpuShardTest : public ::testing::TestWithParam<Case> {
 protected:
  std::vector<std::unique_ptr<Backend>> owned_;
  std::vector<Backend*> shards_;

  void MakeShards(int k) {
    for (int r = 0; r < k; ++r) {
      owned_.push_back(CreateCpuBackend(2));
      shards_.push_back(owned_.back().get());
    }
  }
};

// The float64 reference, loss and lse to fp32 level (the shards' statistics are fp32), dH to one
// ulp of the dtype, dW as the unsharded backend.
void ExpectMatchesReference(const Problem& p, const Outputs& out, const ReferenceResult& ref,
                            const std::vector<float>& grad_weight_before) {
  const double loss_rel = 4e-6;
  const double dh_rel = p.dtype == DType::kBF16 ? 0x1p-7 : 1e-5;
  EXPECT_EQ(out.token_count, ref.token_count);
  EXPECT_NEAR(out.loss_sum, ref.loss_sum, loss_rel * (std::fabs(ref.loss_sum) + p.n));
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(out.per_token_loss), ref.per_token_loss, loss_rel, loss_rel),
      1.0)
      << "per_token_loss";
  EXPECT_LE(WorstToleranceRatio(ToDouble(out.per_token_lse), ref.per_token_lse, loss_rel, loss_rel),
            1.0)
      << "per_token_lse";
  for (int64_t t = 0; t < p.n; ++t) {
    if (ref.per_token_loss[t] == 0.0) EXPECT_EQ(out.per_token_loss[t], 0.0f) << "token " << t;
  }
  EXPECT_LE(
      WorstToleranceRatio(out.grad_hidden, ref.grad_hidden, dh_rel, 1e-6 * MaxAbs(ref.grad_hidden)),
      1.0)
      << "grad_hidden";
  std::vector<double> expected_dw = ref.grad_weight;
  for (size_t i = 0; i < grad_weight_before.size(); ++i) expected_dw[i] += grad_weight_before[i];
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(out.grad_weight), expected_dw, 1e-5, 1e-6 * MaxAbs(expected_dw)),
      1.0)
      << "grad_weight";
}

TEST_P(CpuShardTest, MatchesTheReferenceAndTheUnshardedRun) {
  const Case c = GetParam();
  MakeShards(c.shards);
  // V not divisible by 2 or 3; N (prime) over several chunks of a small budget, the last short.
  Problem p{.n = 47, .d = 24, .v = 103, .dtype = c.dtype};
  p.options.reduction = c.reduction;
  p.options.label_smoothing = c.label_smoothing;
  p.options.z_loss = c.z_loss;
  p.options.softcap = c.softcap;
  p.options.grad_scale = 0.75f;
  const Inputs in = MakeRandomInputs(
      p, 1000 + c.shards * 10 + static_cast<int>(c.dtype),
      InputSpec{.hidden_scale = 1.5, .weight_scale = 0.8, .ignore_fraction = c.ignore_fraction});
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  RunOptions options;
  options.workspace_budget = 6000;  // a few tokens per chunk
  const Shard first = ShardRange(p.v, c.shards, 0);
  absl::StatusOr<ShardPlan> plan =
      shards_[0]->PlanShard(ShardProblem{.problem = p, .rows = first.size(), .shards = c.shards},
                            options.workspace_budget);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_LT(plan->chunk_rows, p.n / 2) << "the budget should split the micro-batch";
  options.initial_grad_weight.resize(p.v * p.d);
  for (size_t i = 0; i < options.initial_grad_weight.size(); ++i) {
    options.initial_grad_weight[i] = std::sin(static_cast<float>(i)) * 0.01f;
  }
  absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(shards_);
  ASSERT_TRUE(collective.ok()) << collective.status();
  absl::StatusOr<Outputs> sharded = RunSharded(shards_, collective->get(), in, options);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ExpectMatchesReference(p, *sharded, ref, options.initial_grad_weight);

  // The unsharded run differs only by summation order: fp32 level.
  absl::StatusOr<Outputs> whole = RunOnBackend(*shards_[0], in, options);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NEAR(sharded->loss_sum, whole->loss_sum, 4e-6 * (std::fabs(whole->loss_sum) + p.n));
  EXPECT_LE(WorstToleranceRatio(ToDouble(sharded->grad_weight), ToDouble(whole->grad_weight), 1e-5,
                                1e-6 * MaxAbs(ToDouble(whole->grad_weight))),
            1.0);

  // The host collective sums in rank order in double, as the exchange through the host does: the
  // same bits; and a rerun gives them again.
  absl::StatusOr<Outputs> direct = RunSharded(shards_, nullptr, in, options);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(direct->loss_sum, sharded->loss_sum);
  EXPECT_EQ(direct->per_token_lse, sharded->per_token_lse);
  EXPECT_EQ(direct->grad_hidden, sharded->grad_hidden);
  EXPECT_EQ(direct->grad_weight, sharded->grad_weight);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CpuShardTest,
    ::testing::Values(Case{.shards = 2, .dtype = DType::kFP32, .reduction = Reduction::kMean},
                      Case{.shards = 3,
                           .dtype = DType::kBF16,
                           .reduction = Reduction::kMean,
                           .ignore_fraction = 0.3},
                      Case{.shards = 3,
                           .dtype = DType::kFP32,
                           .reduction = Reduction::kSum,
                           .label_smoothing = 0.1f,
                           .z_loss = 1e-3f,
                           .softcap = 4.0f,
                           .ignore_fraction = 0.2},
                      Case{.shards = 2,
                           .dtype = DType::kBF16,
                           .reduction = Reduction::kNone,
                           .label_smoothing = 0.05f,
                           .softcap = 6.0f}));

TEST(CpuShardSingleTest, OneShardIsTheWholeHead) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(2);
  Backend* const shards[] = {cpu.get()};
  Problem p{.n = 20, .d = 16, .v = 37, .dtype = DType::kFP32};
  const Inputs in = MakeRandomInputs(p, 7);
  absl::StatusOr<Outputs> sharded = RunSharded(shards, nullptr, in);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ExpectMatchesReference(p, *sharded, ReferenceLoss(p, in.hidden, in.weight, in.targets), {});
}

TEST(CpuShardSingleTest, ForwardOnlyGivesTheSameLoss) {
  std::unique_ptr<Backend> a = CreateCpuBackend(1), b = CreateCpuBackend(1);
  Backend* const shards[] = {a.get(), b.get()};
  Problem p{.n = 30, .d = 8, .v = 51, .dtype = DType::kBF16};
  const Inputs in = MakeRandomInputs(p, 8, InputSpec{.ignore_fraction = 0.25});
  absl::StatusOr<Outputs> trained = RunSharded(shards, nullptr, in);
  RunOptions forward;
  forward.grad_hidden = false;
  forward.grad_weight = false;
  absl::StatusOr<Outputs> evaluated = RunSharded(shards, nullptr, in, forward);
  ASSERT_TRUE(trained.ok() && evaluated.ok());
  EXPECT_EQ(trained->loss_sum, evaluated->loss_sum);
  EXPECT_EQ(trained->per_token_loss, evaluated->per_token_loss);
  EXPECT_EQ(trained->token_count, evaluated->token_count);
}

TEST(BalancedChunkRowsTest, FewestEqualChunksInWholeTilesWhereTheyFit) {
  EXPECT_EQ(BalancedChunkRows(8192, 7936), 4096);  // not 7936 + 256
  EXPECT_EQ(BalancedChunkRows(1000, 300), 256);    // 4 chunks of 250, rounded to 256
  EXPECT_EQ(BalancedChunkRows(1000, 255), 250);    // 256 would not fit
  EXPECT_EQ(BalancedChunkRows(100, 100), 100);
  EXPECT_EQ(BalancedChunkRows(47, 500), 47);
  EXPECT_EQ(BalancedChunkRows(47, 16), 16);
  EXPECT_EQ(BalancedChunkRows(5, 0), 1);
}

// Every call refuses what is wrong with INVALID_ARGUMENT and writes nothing.
TEST(CpuShardErrorsTest, RefusesBadCalls) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  std::unique_ptr<Stream> stream = *cpu->CreateStream();
  const Problem p{.n = 8, .d = 4, .v = 10, .dtype = DType::kFP32};
  const ShardProblem shard{.problem = p, .row_begin = 5, .rows = 5, .shards = 2, .rank = 1};
  absl::StatusOr<ShardPlan> plan = cpu->PlanShard(shard, 1 << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunk_rows, 8);
  EXPECT_EQ(plan->stats_floats, 2 * kShardStats * 8);
  EXPECT_EQ(plan->partial_floats, 8 * 4);
  EXPECT_EQ(cpu->PlanShard(shard, 100).status().code(), absl::StatusCode::kResourceExhausted);

  std::vector<float> hidden(p.n * p.d, 0.5f), weight(5 * p.d, 0.25f), grad(5 * p.d, 1.0f);
  std::vector<float> stats(plan->stats_floats, -3.0f), partial(plan->partial_floats);
  std::vector<int32_t> targets(p.n, 7);
  std::vector<char> workspace(plan->workspace_bytes);
  ShardArguments args{.hidden = hidden.data(),
                      .weight = weight.data(),
                      .targets = targets.data(),
                      .grad_weight = grad.data(),
                      .grad_hidden_partial = partial.data(),
                      .stats = stats.data(),
                      .stats_chunk_rows = plan->chunk_rows,
                      .workspace = workspace.data(),
                      .workspace_bytes = workspace.size()};
  const std::vector<float> stats_before = stats, grad_before = grad;
  auto expect_invalid = [&](absl::Status status, const char* what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << status;
    EXPECT_EQ(stats, stats_before) << what;
    EXPECT_EQ(grad, grad_before) << what;
  };
  ShardProblem bad = shard;
  bad.rank = 2;
  expect_invalid(cpu->ShardForward(bad, args, {0, 8}, *stream), "rank >= shards");
  bad = shard;
  bad.row_begin = 6;
  expect_invalid(cpu->ShardForward(bad, args, {0, 8}, *stream), "rows beyond v");
  expect_invalid(cpu->ShardForward(shard, args, {4, 8}, *stream), "chunk beyond n");
  ShardArguments small = args;
  small.stats_chunk_rows = 4;
  expect_invalid(cpu->ShardForward(shard, small, {0, 8}, *stream), "chunk > stats_chunk_rows");
  ShardArguments no_stats = args;
  no_stats.stats = nullptr;
  expect_invalid(cpu->ShardBackward(shard, no_stats, {0, 8}, *stream), "null stats");
  ShardArguments tight = args;
  tight.workspace_bytes = 64;
  expect_invalid(cpu->ShardBackward(shard, tight, {0, 8}, *stream), "workspace too small");
  // Deferred dW: a stash beside a dW, and a micro-batch past the stash's rows.
  const absl::StatusOr<size_t> stash_bytes = cpu->GradStashBytes(ShardStashShape(shard), 10);
  ASSERT_TRUE(stash_bytes.ok()) << stash_bytes.status();
  std::vector<char> stash(*stash_bytes, 7);
  const std::vector<char> stash_before = stash;
  ShardArguments stashed = args;
  stashed.grad_stash = GradStash{.data = stash.data(), .capacity = 10, .tokens = 0};
  expect_invalid(cpu->ShardBackward(shard, stashed, {0, 8}, *stream), "stash beside dW");
  stashed.grad_weight = nullptr;
  stashed.grad_stash.tokens = 3;  // rows [3, 11) of 10
  expect_invalid(cpu->ShardBegin(shard, stashed, *stream), "rows past the stash");
  expect_invalid(cpu->ShardBackward(shard, stashed, {0, 8}, *stream), "rows past the stash");
  EXPECT_EQ(stash, stash_before);
  targets[3] = 10;  // outside [0, v)
  expect_invalid(cpu->ShardBegin(shard, args, *stream), "target outside v");
  EXPECT_EQ(cpu->ShardStoreGradHidden(shard, nullptr, {0, 8}, hidden.data(), *stream).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::kernels
