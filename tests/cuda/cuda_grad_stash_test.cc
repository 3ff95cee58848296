// Deferred dW on the CUDA backend: micro-batches run into a gradient stash and flushed in groups
// add up to the float64 dW of them all (within the dtype's tolerance: the stash rounds the scaled
// G to it, as the undeferred run rounds the unscaled one); each one's loss is the undeferred run's
// bit for bit and its dH within the same tolerance; a rerun gives the same bits. Shapes with
// several chunks per micro-batch and with the two-stream overlap are included, and the same
// sequences through 2 and 3 vocabulary shards with a stash each.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/tolerance.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/grad_stash_cases.h"
#include "tests/kernels/grad_stash_runner.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

using testing::Inputs;
using testing::MakeStashBatches;
using testing::ReferenceGradWeight;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::RunShardedStashed;
using testing::RunStashed;
using testing::StashCase;
using testing::StashCases;
using testing::StashedRun;

// ||a - b|| / ||b||; NaN or Inf in `a` gives +inf.
double RelNorm(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<StashCase> Cases() {
  std::vector<StashCase> cases = StashCases(DType::kFP32);
  for (auto& c : StashCases(DType::kBF16)) cases.push_back(c);
  // Micro-batches of several chunks (the budget below holds about 256 rows of logits), the
  // larger ones split in two halves for the overlap of the row kernel and the GEMMs.
  for (DType dtype : {DType::kBF16, DType::kFP32}) {
    cases.push_back({.name = std::string(DTypeName(dtype)) + "_chunked",
                     .dtype = dtype,
                     .options = LossOptions{.grad_scale = 2.0f, .label_smoothing = 0.05f},
                     .ignore_fraction = 0.1,
                     .v = 1000,
                     .d = 128,
                     .sizes = {600, 300, 1100, 40, 700},
                     .capacity = 2048});
  }
  // An fp32 head on the TF32 tensor cores: the flush's GEMM computes as the micro-batches' did.
  StashCase high = cases.back();
  high.name = "fp32_chunked_high";
  high.precision = MatmulPrecision::kHigh;
  cases.push_back(high);
  return cases;
}

// Two stashed runs of `batches`: the first flushed as often as the case wants, its dW is their
// float64 dW within the tolerance, each answer is the same micro-batch's run `undeferred` (loss
// bit for bit, dH within the tolerance), and the second gave the first's bits.
void ExpectStashedRunsMatch(
    const StashCase& c, const std::vector<Inputs>& batches, const Tolerance& tol,
    const StashedRun& run, const StashedRun& again,
    absl::FunctionRef<absl::StatusOr<testing::Outputs>(const Inputs&)> undeferred) {
  EXPECT_GE(run.flushes, c.min_flushes);
  const std::vector<double> expected = ReferenceGradWeight(batches);
  EXPECT_LE(RelNorm(std::vector<double>(run.grad_weight.begin(), run.grad_weight.end()), expected),
            tol.dw);
  for (size_t i = 0; i < batches.size(); ++i) {
    auto want = undeferred(batches[i]);
    ASSERT_TRUE(want.ok()) << want.status();
    const testing::Outputs& got = run.microbatches[i];
    EXPECT_EQ(got.token_count, want->token_count) << i;
    EXPECT_EQ(std::memcmp(&got.loss_sum, &want->loss_sum, 4), 0) << i;
    EXPECT_LE(RelNorm(got.grad_hidden, want->grad_hidden), tol.dh) << i;
  }
  EXPECT_EQ(std::memcmp(again.grad_weight.data(), run.grad_weight.data(),
                        run.grad_weight.size() * sizeof(float)),
            0);
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_EQ(again.microbatches[i].grad_hidden, run.microbatches[i].grad_hidden) << i;
  }
}

class CudaGradStashTest : public ::testing::TestWithParam<StashCase> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU";
  }
  static void CheckCase(const StashCase& c, const CudaBackendOptions& options);
};

TEST_P(CudaGradStashTest, FlushedStashAddsUpToEveryMicroBatchAndAnswersMatch) {
  const StashCase& c = GetParam();
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "one stream");
    CheckCase(c, CudaBackendOptions{.overlap = overlap});
  }
  SCOPED_TRACE("our logits GEMM");
  CheckCase(c, CudaBackendOptions{.sm90_logits_gemm = true});
}

void CudaGradStashTest::CheckCase(const StashCase& c, const CudaBackendOptions& options) {
  auto backend = CreateCudaBackend(0, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batches = MakeStashBatches(c, 20261124);
  // At least 256 rows of logits per chunk for the wide case (512 in bf16: halves for the
  // overlap); everything at once otherwise.
  const size_t budget = c.v >= 1000 ? (size_t{8} << 20) + 256 * 1008 * 4 : size_t{64} << 20;
  auto run = RunStashed(**backend, batches, c.capacity, budget);
  auto again = RunStashed(**backend, batches, c.capacity, budget);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectStashedRunsMatch(
      c, batches,
      ToleranceFor(c.dtype, options.bf16_logits && c.dtype == DType::kBF16, c.precision), *run,
      *again, [&](const Inputs& in) {
        return RunOnBackend(**backend, in,
                            RunOptions{.workspace_budget = budget, .per_token = false});
      });
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGradStashTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// The same through k vocabulary shards of one head on one GPU, each shard with a stash of its own
// (RunShardedStashed): dW against float64, each answer against the shards' undeferred run (loss
// bit for bit, dH within the tolerance), and a rerun bit for bit.
class CudaShardGradStashTest : public ::testing::TestWithParam<std::tuple<StashCase, int>> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU";
  }
};

TEST_P(CudaShardGradStashTest, FlushedStashesAddUpToEveryMicroBatchAndAnswersMatch) {
  const auto& [c, k] = GetParam();
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> shards;
  for (int r = 0; r < k; ++r) {
    auto backend = CreateCudaBackend(0);
    ASSERT_TRUE(backend.ok()) << backend.status();
    owned.push_back(*std::move(backend));
    shards.push_back(owned.back().get());
  }
  const auto batches = MakeStashBatches(c, 20261125 + k);
  const size_t budget = c.v >= 1000 ? (size_t{8} << 20) + 256 * 1008 * 4 : size_t{64} << 20;
  if (c.v >= 1000) {
    // The wide case's larger micro-batches run in several chunks.
    const Shard rows = ShardRange(c.v, k, 0);
    const ShardProblem largest{.problem = batches[2].problem,
                               .row_begin = rows.begin,
                               .rows = rows.size(),
                               .shards = k,
                               .rank = 0};
    auto plan = shards[0]->PlanShard(largest, budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LT(plan->chunk_rows, largest.problem.n);
  }
  auto run = RunShardedStashed(shards, batches, c.capacity, budget);
  auto again = RunShardedStashed(shards, batches, c.capacity, budget);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectStashedRunsMatch(c, batches, ToleranceFor(c.dtype, c.dtype == DType::kBF16, c.precision),
                         *run, *again, [&](const Inputs& in) {
                           return RunSharded(
                               shards, nullptr, in,
                               RunOptions{.workspace_budget = budget, .per_token = false});
                         });
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaShardGradStashTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_k" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(CudaGradStashErrorsTest, Fp16HeadsHaveNoStash) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU";
  auto backend = CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Problem fp16{.n = 4, .d = 8, .v = 16, .dtype = DType::kFP16};
  EXPECT_EQ((*backend)->GradStashBytes(fp16, 8).status().code(), absl::StatusCode::kUnimplemented);
  const Problem bf16{.n = 4, .d = 8, .v = 16, .dtype = DType::kBF16};
  EXPECT_EQ((*backend)->GradStashBytes(bf16, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*backend)->GradStashBytes(bf16, 8).ok());

  // Nor do their vocabulary shards.
  const ShardProblem shard{.problem = fp16, .row_begin = 8, .rows = 8, .shards = 2, .rank = 1};
  auto plan = (*backend)->PlanShard(shard, size_t{64} << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto stream = (*backend)->CreateStream();
  auto workspace = (*backend)->Allocate(plan->workspace_bytes);
  auto memory = (*backend)->Allocate(size_t{1} << 20);  // room for every other buffer
  ASSERT_TRUE(stream.ok() && workspace.ok() && memory.ok());
  char* base = memory->as<char>();
  ShardArguments args{.hidden = base,
                      .weight = base,
                      .targets = reinterpret_cast<const int32_t*>(base),
                      .grad_stash = GradStash{.data = base + (512 << 10), .capacity = 8},
                      .stats = reinterpret_cast<float*>(base + (256 << 10)),
                      .stats_chunk_rows = plan->chunk_rows,
                      .workspace = workspace->data(),
                      .workspace_bytes = plan->workspace_bytes};
  EXPECT_EQ((*backend)->ShardBegin(shard, args, **stream).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ((*backend)->ShardBackward(shard, args, ShardChunk{0, 4}, **stream).code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace losshead::kernels
