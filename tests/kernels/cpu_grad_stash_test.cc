// Deferred dW on the CPU backend: micro-batches run into a gradient stash and flushed in groups
// add up to the float64 dW of them all; each one's loss and dH are the undeferred run's bit for
// bit (the CPU backend's G is the same fp32 values either way); the same over 2 and 3 vocabulary
// shards with a stash each. Bad arguments launch nothing.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/grad_stash_cases.h"
#include "tests/kernels/grad_stash_runner.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

using testing::Inputs;
using testing::MakeStashBatches;
using testing::MaxAbs;
using testing::ReferenceGradWeight;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::RunShardedStashed;
using testing::RunStashed;
using testing::StashCase;
using testing::StashCases;
using testing::StashedRun;
using testing::ToDouble;
using testing::WorstToleranceRatio;

// A stashed run of `batches`: it flushed as often as the case wants, its dW is their float64 dW,
// and each answer is the same micro-batch's run `undeferred`, bit for bit.
void ExpectStashedRunMatches(
    const StashCase& c, const std::vector<Inputs>& batches, const StashedRun& run,
    absl::FunctionRef<absl::StatusOr<testing::Outputs>(const Inputs&)> undeferred) {
  EXPECT_GE(run.flushes, c.min_flushes);
  const std::vector<double> expected = ReferenceGradWeight(batches);
  ASSERT_GT(MaxAbs(expected), 0.0);
  EXPECT_LE(WorstToleranceRatio(ToDouble(run.grad_weight), expected, 1e-5, 1e-6 * MaxAbs(expected)),
            1.0);
  for (size_t i = 0; i < batches.size(); ++i) {
    auto want = undeferred(batches[i]);
    ASSERT_TRUE(want.ok()) << want.status();
    const testing::Outputs& got = run.microbatches[i];
    EXPECT_EQ(got.token_count, want->token_count) << i;
    EXPECT_EQ(got.loss_sum, want->loss_sum) << i;
    EXPECT_EQ(got.grad_hidden, want->grad_hidden) << i;
  }
}

class CpuGradStashTest : public ::testing::TestWithParam<StashCase> {};

TEST_P(CpuGradStashTest, FlushedStashAddsUpToEveryMicroBatchAndAnswersAreUnchanged) {
  const StashCase& c = GetParam();
  auto backend = CreateCpuBackend(2);
  const auto batches = MakeStashBatches(c, 20261124);
  auto run = RunStashed(*backend, batches, c.capacity);
  ASSERT_TRUE(run.ok()) << run.status();
  ExpectStashedRunMatches(c, batches, *run, [&](const Inputs& in) {
    return RunOnBackend(*backend, in, RunOptions{.per_token = false});
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuGradStashTest, ::testing::ValuesIn([] {
                           auto cases = StashCases(DType::kFP32);
                           for (auto& c : StashCases(DType::kBF16)) cases.push_back(c);
                           return cases;
                         }()),
                         [](const auto& info) { return info.param.name; });

// The same through k vocabulary shards, each with a stash of its own: dW against float64, each
// answer against the shards' undeferred run, bit for bit.
class CpuShardGradStashTest : public ::testing::TestWithParam<std::tuple<StashCase, int>> {};

TEST_P(CpuShardGradStashTest, FlushedStashesAddUpToEveryMicroBatchAndAnswersAreUnchanged) {
  const auto& [c, k] = GetParam();
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> shards;
  for (int r = 0; r < k; ++r) {
    owned.push_back(CreateCpuBackend(2));
    shards.push_back(owned.back().get());
  }
  const auto batches = MakeStashBatches(c, 20261125 + k);
  auto run = RunShardedStashed(shards, batches, c.capacity);
  ASSERT_TRUE(run.ok()) << run.status();
  ExpectStashedRunMatches(c, batches, *run, [&](const Inputs& in) {
    return RunSharded(shards, nullptr, in, RunOptions{.per_token = false});
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuShardGradStashTest,
                         ::testing::Combine(::testing::ValuesIn([] {
                                              auto cases = StashCases(DType::kFP32);
                                              for (auto& c : StashCases(DType::kBF16)) {
                                                cases.push_back(c);
                                              }
                                              return cases;
                                            }()),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_k" +
                                  std::to_string(std::get<1>(info.param));
                         });

// A stash of 4 tokens with one micro-batch of 3 in it, for the error cases.
class CpuGradStashErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = CreateCpuBackend(1);
    auto stream = backend_->CreateStream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
    problem_ = Problem{.n = 3, .d = 4, .v = 5};
    auto bytes = backend_->GradStashBytes(problem_, 4);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    stash_.resize(*bytes / sizeof(float), 7.0f);
    hidden_.assign(12, 0.5f);
    weight_.assign(20, 0.25f);
    grad_weight_.assign(20, 1.0f);
    args_.hidden = hidden_.data();
    args_.weight = weight_.data();
    args_.targets = targets_;
    args_.loss_sum = &loss_sum_;
    args_.token_count = &token_count_;
    auto ws = backend_->WorkspaceBytes(problem_, size_t{1} << 20);
    ASSERT_TRUE(ws.ok());
    workspace_.resize(*ws);
    args_.workspace = workspace_.data();
    args_.workspace_bytes = workspace_.size();
    args_.grad_stash = GradStash{.data = stash_.data(), .capacity = 4, .tokens = 1};
  }
  void ExpectUntouched() {
    EXPECT_EQ(loss_sum_, -1.0f);
    for (float x : stash_) ASSERT_EQ(x, 7.0f);
    for (float x : grad_weight_) ASSERT_EQ(x, 1.0f);
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  Problem problem_;
  std::vector<float> stash_, hidden_, weight_, grad_weight_;
  std::vector<char> workspace_;
  int32_t targets_[3] = {0, 4, 2};
  float loss_sum_ = -1.0f;
  int64_t token_count_ = -1;
  Arguments args_;
};

TEST_F(CpuGradStashErrorsTest, RowsBeyondTheCapacityAreRefused) {
  args_.grad_stash.tokens = 2;  // rows [2, 5) of 4
  EXPECT_EQ(backend_->Run(problem_, args_, *stream_).code(), absl::StatusCode::kInvalidArgument);
  args_.grad_stash.tokens = -1;
  EXPECT_EQ(backend_->Run(problem_, args_, *stream_).code(), absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(CpuGradStashErrorsTest, AStashAndADwTogetherAreRefused) {
  args_.grad_weight = grad_weight_.data();
  EXPECT_EQ(backend_->Run(problem_, args_, *stream_).code(), absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(CpuGradStashErrorsTest, AFlushNeedsDwAndRowsWithinTheStash) {
  GradStash stash = args_.grad_stash;
  EXPECT_EQ(backend_->FlushGradStash(problem_, stash, nullptr, nullptr, 0, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  stash.tokens = 5;
  EXPECT_EQ(
      backend_->FlushGradStash(problem_, stash, grad_weight_.data(), nullptr, 0, *stream_).code(),
      absl::StatusCode::kInvalidArgument);
  stash.data = nullptr;
  stash.tokens = 1;
  EXPECT_EQ(
      backend_->FlushGradStash(problem_, stash, grad_weight_.data(), nullptr, 0, *stream_).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->GradStashBytes(problem_, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(CpuGradStashErrorsTest, AnEmptyFlushAddsNothing) {
  GradStash stash = args_.grad_stash;
  stash.tokens = 0;
  EXPECT_TRUE(
      backend_->FlushGradStash(problem_, stash, grad_weight_.data(), nullptr, 0, *stream_).ok());
  ExpectUntouched();
}

}  // namespace
}  // namespace losshead::kernels
