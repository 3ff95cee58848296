// The distribution outputs and the top-k (Arguments, problem.h) on the CPU backend: over vocabulary
// shards against the one-device Run and the float64 references, the top-k of both paths with
// exact ties and near-ties that fp32 resolves exactly, and the errors of bad top-k and shard calls.
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/distribution_checks.h"
#include "tests/kernels/reference_loss.h"
#include "tests/kernels/reference_topk.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

using testing::AimEveryOtherTarget;
using testing::DistributionTolerance;
using testing::ExpectDistributionMatchesReference;
using testing::ExpectDistributionsAgree;
using testing::ExpectSameLossBits;
using testing::Inputs;
using testing::InputSpec;
using testing::LadderInputs;
using testing::MakeRandomInputs;
using testing::Outputs;
using testing::ReferenceLoss;
using testing::ReferenceResult;
using testing::ReferenceTopK;
using testing::ReferenceTopKResult;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::TopKCheck;

RunOptions AllOutputs(int32_t top_k, size_t workspace_budget) {
  RunOptions options;
  options.workspace_budget = workspace_budget;
  options.logprob = options.entropy = options.argmax = options.correct_count = true;
  options.top_k = top_k;
  return options;
}

constexpr size_t kWhole = size_t{64} << 20;
constexpr size_t kSmall = 12000;  // a few tokens per chunk

struct Case {
  std::string name;
  int shards;
  DType dtype;
  LossOptions options;
  int32_t top_k;
  size_t workspace_budget;  // small ones split the micro-batch into chunks
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CpuShardDistributionTest : public ::testing::TestWithParam<Case> {
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

TEST_P(CpuShardDistributionTest, MatchesTheWholeRunAndTheFloat64References) {
  const Case& c = GetParam();
  MakeShards(c.shards);
  // V not divisible by 2, 3 or 4; N over several chunks of the small budgets.
  const Problem p{.n = 61, .d = 24, .v = 203, .dtype = c.dtype, .options = c.options};
  Inputs in =
      MakeRandomInputs(p, std::hash<std::string>()(c.name),
                       InputSpec{.hidden_scale = 1.5, .weight_scale = 0.8, .ignore_fraction = 0.3});
  AimEveryOtherTarget(in);
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  const ReferenceTopKResult topk = ReferenceTopK(p, in.hidden, in.weight, in.targets, c.top_k);
  const RunOptions options = AllOutputs(c.top_k, c.workspace_budget);
  RunOptions plain;
  plain.workspace_budget = c.workspace_budget;
  if (c.workspace_budget == kSmall) {
    const Shard first = ShardRange(p.v, c.shards, 0);
    absl::StatusOr<ShardPlan> plan = shards_[0]->PlanShard(
        ShardProblem{.problem = p, .rows = first.size(), .shards = c.shards}, kSmall);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_LT(plan->chunk_rows, p.n / 2) << "the budget should split the micro-batch";
  }

  absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(shards_);
  ASSERT_TRUE(collective.ok()) << collective.status();
  absl::StatusOr<Outputs> sharded = RunSharded(shards_, collective->get(), in, options);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<Outputs> sharded_plain = RunSharded(shards_, collective->get(), in, plain);
  ASSERT_TRUE(sharded_plain.ok()) << sharded_plain.status();
  absl::StatusOr<Outputs> whole = RunOnBackend(*shards_[0], in, options);
  ASSERT_TRUE(whole.ok()) << whole.status();

  // Asking for the outputs changes no loss output of the shards by a bit.
  ExpectSameLossBits(*sharded, *sharded_plain);
  // The shards' statistics are fp32 (the one-device row keeps its sums in double): fp32 level.
  const DistributionTolerance tol{.rel = 1e-5, .near_tie = 1e-4};
  {
    SCOPED_TRACE("sharded against float64");
    ExpectDistributionMatchesReference(in, *sharded, ref, &topk, tol);
  }
  {
    SCOPED_TRACE("whole against float64");
    ExpectDistributionMatchesReference(in, *whole, ref, &topk,
                                       DistributionTolerance{.rel = 2e-6, .near_tie = 1e-4});
  }
  {
    SCOPED_TRACE("sharded against whole");
    ExpectDistributionsAgree(in, *sharded, *whole, ref, &topk, tol);
  }
  // Without label smoothing and z-loss the loss is -log p_y on both paths.
  if (p.options.label_smoothing == 0.0f && p.options.z_loss == 0.0f) {
    for (int64_t t = 0; t < p.n; ++t) {
      if (in.targets[t] == p.options.ignore_index) continue;
      EXPECT_EQ(sharded->per_token_logprob[t], -sharded->per_token_loss[t]) << "token " << t;
    }
  }
  // The exchange through the host gives the same bits as the host collective; reruns too.
  absl::StatusOr<Outputs> direct = RunSharded(shards_, nullptr, in, options);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_TRUE(testing::SameFloatBits(direct->per_token_entropy, sharded->per_token_entropy));
  EXPECT_TRUE(testing::SameFloatBits(direct->top_k_logprobs, sharded->top_k_logprobs));
  EXPECT_EQ(direct->top_k_ids, sharded->top_k_ids);
  EXPECT_EQ(direct->correct_count, sharded->correct_count);
}

LossOptions Options(Reduction reduction, float label_smoothing = 0.0f, float z_loss = 0.0f,
                    float softcap = 0.0f) {
  return {.reduction = reduction,
          .label_smoothing = label_smoothing,
          .z_loss = z_loss,
          .softcap = softcap};
}

LossOptions IgnoringClassZero() {
  LossOptions options = Options(Reduction::kMean);
  options.ignore_index = 0;
  return options;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuShardDistributionTest,
    ::testing::Values(
        Case{"OneShard_FP32", 1, DType::kFP32, Options(Reduction::kMean), 5, kWhole},
        Case{"TwoShards_BF16_Top1", 2, DType::kBF16, Options(Reduction::kSum), 1, kSmall},
        Case{"ThreeShards_FP32_SmoothingZLoss", 3, DType::kFP32,
             Options(Reduction::kMean, 0.1f, 1e-3f), 5, kSmall},
        Case{"FourShards_BF16_Softcap_Top16", 4, DType::kBF16,
             Options(Reduction::kNone, 0.0f, 0.0f, 3.0f), 16, kWhole},
        Case{"ThreeShards_FP16_Everything", 3, DType::kFP16,
             Options(Reduction::kMean, 0.05f, 1e-4f, 30.0f), 7, kSmall},
        Case{"TwoShards_FP32_IgnoreIndexInVocab", 2, DType::kFP32, IgnoringClassZero(), 3, kWhole}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Exact ties go to the lower id and near-ties to the larger z, on the one-device path and over
// shards (including shards of fewer columns than k, which pad their candidates).
TEST(CpuTopK, ExactTiesAndNearTiesMatchFloat64Exactly) {
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (int64_t v : {int64_t{20}, int64_t{61}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " v " << v);
      const Problem p{
          .n = 48, .d = 8, .v = v, .dtype = dtype, .options = Options(Reduction::kMean)};
      const Inputs in = LadderInputs(p, 4300 + v + static_cast<int>(dtype));
      const int32_t k = 16;
      const ReferenceTopKResult topk = ReferenceTopK(p, in.hidden, in.weight, in.targets, k);
      const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
      int64_t close = 0;
      for (int64_t t = 0; t < p.n; ++t) close += topk.margin[t] <= 2 * 0x1p-7 ? 1 : 0;
      EXPECT_GT(close, p.n / 2) << "the inputs should hold near-ties";

      std::unique_ptr<Backend> one = CreateCpuBackend(2);
      absl::StatusOr<Outputs> whole = RunOnBackend(*one, in, AllOutputs(k, kWhole));
      ASSERT_TRUE(whole.ok()) << whole.status();
      TopKCheck check = CheckTopK(topk, whole->top_k_ids, whole->top_k_logprobs, 2e-6, 0.0);
      EXPECT_EQ(check.error, "");
      EXPECT_GT(check.exact_ties, p.n / 2) << "the inputs should hold exact ties";
      EXPECT_EQ(whole->per_token_argmax, ref.per_token_argmax);

      for (int shards : {2, 4}) {
        SCOPED_TRACE(::testing::Message() << shards << " shards");
        std::vector<std::unique_ptr<Backend>> owned;
        std::vector<Backend*> backends;
        for (int r = 0; r < shards; ++r) {
          owned.push_back(CreateCpuBackend(1));
          backends.push_back(owned.back().get());
        }
        absl::StatusOr<Outputs> sharded = RunSharded(backends, nullptr, in, AllOutputs(k, kSmall));
        ASSERT_TRUE(sharded.ok()) << sharded.status();
        check = CheckTopK(topk, sharded->top_k_ids, sharded->top_k_logprobs, 1e-5, 0.0);
        EXPECT_EQ(check.error, "");
        EXPECT_EQ(sharded->top_k_ids, whole->top_k_ids);
        EXPECT_EQ(sharded->per_token_argmax, ref.per_token_argmax);
        EXPECT_EQ(sharded->correct_count, ref.correct_count);
      }
    }
  }
}

// The top-k ids alone, or the log-probs alone, are what they are when both are asked for, and a
// forward-only call gives them too.
TEST(CpuTopK, EachHalfAloneAndForwardOnly) {
  const Problem p{.n = 30,
                  .d = 16,
                  .v = 150,
                  .dtype = DType::kBF16,
                  .options = Options(Reduction::kMean, 0.1f, 0.0f, 10.0f)};
  const Inputs in = MakeRandomInputs(p, 4302, InputSpec{.ignore_fraction = 0.25});
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  RunOptions both;
  both.top_k = 4;
  absl::StatusOr<Outputs> all = RunOnBackend(*backend, in, both);
  ASSERT_TRUE(all.ok()) << all.status();
  RunOptions plain;
  absl::StatusOr<Outputs> none = RunOnBackend(*backend, in, plain);
  ASSERT_TRUE(none.ok()) << none.status();
  ExpectSameLossBits(*all, *none);
  RunOptions forward = both;
  forward.grad_hidden = forward.grad_weight = false;
  absl::StatusOr<Outputs> forward_only = RunOnBackend(*backend, in, forward);
  ASSERT_TRUE(forward_only.ok()) << forward_only.status();
  EXPECT_EQ(forward_only->top_k_ids, all->top_k_ids);
  EXPECT_TRUE(testing::SameFloatBits(forward_only->top_k_logprobs, all->top_k_logprobs));

  // Ids only, through the Backend API directly.
  std::vector<int32_t> ids(p.n * 4, 7);
  std::vector<float> loss_sum(1);
  std::vector<int64_t> count(1);
  absl::StatusOr<size_t> bytes = backend->WorkspaceBytes(p, size_t{1} << 22);
  ASSERT_TRUE(bytes.ok());
  std::vector<char> workspace(*bytes);
  Arguments args;
  args.hidden = in.hidden_bytes.data();
  args.weight = in.weight_bytes.data();
  args.targets = in.targets.data();
  args.loss_sum = loss_sum.data();
  args.token_count = count.data();
  args.top_k = 4;
  args.top_k_ids = ids.data();
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.size();
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(backend->Run(p, args, **stream).ok());
  EXPECT_EQ(ids, all->top_k_ids);
}

// A top_k outside [1, min(kMaxTopK, V)] with a top-k output is INVALID_ARGUMENT, before anything
// is written; without a top-k output top_k is not read.
TEST(CpuTopKErrors, BadTopKIsRefusedAndWritesNothing) {
  const Problem p{.n = 8, .d = 16, .v = 12, .dtype = DType::kFP32};
  const Inputs in = MakeRandomInputs(p, 7);
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  absl::StatusOr<size_t> bytes = backend->WorkspaceBytes(p, size_t{1} << 20);
  ASSERT_TRUE(bytes.ok());
  std::vector<char> workspace(*bytes);
  std::vector<int32_t> ids(p.n * (kMaxTopK + 1), 7);
  std::vector<float> logprobs(p.n * (kMaxTopK + 1), 7.0f);
  float loss_sum = 7.0f;
  int64_t token_count = 7;
  Arguments args;
  args.hidden = in.hidden_bytes.data();
  args.weight = in.weight_bytes.data();
  args.targets = in.targets.data();
  args.loss_sum = &loss_sum;
  args.token_count = &token_count;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.size();
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  for (int32_t top_k : {0, -1, 13, kMaxTopK + 1}) {
    for (int which = 0; which < 2; ++which) {
      SCOPED_TRACE(::testing::Message() << "top_k " << top_k << " which " << which);
      args.top_k = top_k;
      args.top_k_ids = which == 0 ? ids.data() : nullptr;
      args.top_k_logprobs = which == 1 ? logprobs.data() : nullptr;
      const absl::Status status = backend->Run(p, args, **stream);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("top_k"), std::string::npos) << status;
    }
  }
  EXPECT_EQ(ids, std::vector<int32_t>(ids.size(), 7));
  EXPECT_EQ(logprobs, std::vector<float>(logprobs.size(), 7.0f));
  EXPECT_EQ(loss_sum, 7.0f);
  EXPECT_EQ(token_count, 7);
  // No top-k output: top_k is not read.
  args.top_k = 99;
  args.top_k_ids = nullptr;
  args.top_k_logprobs = nullptr;
  EXPECT_TRUE(backend->Run(p, args, **stream).ok());
  // The largest allowed, and top_k = V.
  args.top_k_ids = ids.data();
  args.top_k = 12;
  EXPECT_TRUE(backend->Run(p, args, **stream).ok());
  EXPECT_NE(ids[0], 7);
}

// The shard calls need output_stats with any distribution output, and a top_k in range.
TEST(CpuShardDistributionErrors, OutputStatsAndTopKAreChecked) {
  ShardProblem shard;
  shard.problem = Problem{.n = 4, .d = 8, .v = 16, .dtype = DType::kFP32};
  shard.rows = 8;
  shard.shards = 2;
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  absl::StatusOr<ShardPlan> plan = backend->PlanShard(shard, size_t{1} << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<float> hidden(4 * 8, 0.5f), weight(8 * 8, 0.25f);
  std::vector<int32_t> targets = {0, 3, 9, 15};
  std::vector<float> stats(plan->stats_floats), entropy(4, 7.0f);
  std::vector<float> output_stats(2 * ShardOutputStatsRows(kMaxTopK) * plan->chunk_rows);
  std::vector<char> workspace(plan->workspace_bytes);
  int32_t argmax[4] = {7, 7, 7, 7};
  int64_t correct = 7;
  ShardArguments args;
  args.hidden = hidden.data();
  args.weight = weight.data();
  args.targets = targets.data();
  args.stats = stats.data();
  args.stats_chunk_rows = plan->chunk_rows;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.size();
  args.per_token_entropy = entropy.data();
  args.per_token_argmax = argmax;
  args.correct_count = &correct;
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  const ShardChunk chunk{0, 4};
  auto all_calls = [&]() {
    return std::vector<absl::Status>{backend->ShardBegin(shard, args, **stream),
                                     backend->ShardForward(shard, args, chunk, **stream),
                                     backend->ShardBackward(shard, args, chunk, **stream)};
  };
  for (const absl::Status& status : all_calls()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("output_stats"), std::string::npos) << status;
    EXPECT_NE(status.message().find("per_token_entropy, per_token_argmax, correct_count"),
              std::string::npos)
        << status;
  }
  args.output_stats = output_stats.data();
  for (int32_t top_k : {-1, kMaxTopK + 1, 17}) {
    args.top_k = top_k;
    for (const absl::Status& status : all_calls()) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("top_k"), std::string::npos) << status;
    }
  }
  std::vector<int32_t> ids(4 * 3, 7);
  args.top_k = 0;
  args.top_k_ids = ids.data();
  for (const absl::Status& status : all_calls()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  EXPECT_EQ(entropy, std::vector<float>(4, 7.0f));
  EXPECT_EQ(argmax[0], 7);
  EXPECT_EQ(correct, 7);
  EXPECT_EQ(ids, std::vector<int32_t>(ids.size(), 7));
  args.top_k = 3;
  EXPECT_TRUE(backend->ShardBegin(shard, args, **stream).ok());
  EXPECT_EQ(correct, 0);
}

}  // namespace
}  // namespace losshead::kernels
