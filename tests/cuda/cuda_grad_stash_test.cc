// Deferred dW on the CUDA backend: micro-batches run into a gradient stash and flushed in groups
// add up to the float64 dW of them all (within the dtype's tolerance: the stash rounds the scaled
// G to it, as the undeferred run rounds the unscaled one); each one's loss is the undeferred run's
// bit for bit and its dH within the same tolerance; a rerun gives the same bits. Shapes with
// several chunks per micro-batch and with the two-stream overlap are included.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/tolerance.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/grad_stash_cases.h"
#include "tests/kernels/grad_stash_runner.h"

namespace losshead::kernels {
namespace {

using testing::MakeStashBatches;
using testing::ReferenceGradWeight;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunStashed;
using testing::StashCase;
using testing::StashCases;

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
  return cases;
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
}

void CudaGradStashTest::CheckCase(const StashCase& c, const CudaBackendOptions& options) {
  auto backend = CreateCudaBackend(0, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batches = MakeStashBatches(c, 20261124);
  // At least 256 rows of logits per chunk for the wide case (512 in bf16: halves for the
  // overlap); everything at once otherwise.
  const size_t budget = c.v >= 1000 ? (size_t{8} << 20) + 256 * 1008 * 4 : size_t{64} << 20;
  auto run = RunStashed(**backend, batches, c.capacity, budget);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_GE(run->flushes, c.min_flushes);
  const Tolerance tol = ToleranceFor(c.dtype, options.bf16_logits && c.dtype == DType::kBF16);

  const std::vector<double> expected = ReferenceGradWeight(batches);
  EXPECT_LE(
      RelNorm(std::vector<double>(run->grad_weight.begin(), run->grad_weight.end()), expected),
      tol.dw);
  for (size_t i = 0; i < batches.size(); ++i) {
    auto undeferred = RunOnBackend(**backend, batches[i],
                                   RunOptions{.workspace_budget = budget, .per_token = false});
    ASSERT_TRUE(undeferred.ok()) << undeferred.status();
    const testing::Outputs& got = run->microbatches[i];
    EXPECT_EQ(got.token_count, undeferred->token_count) << i;
    EXPECT_EQ(std::memcmp(&got.loss_sum, &undeferred->loss_sum, 4), 0) << i;
    EXPECT_LE(RelNorm(got.grad_hidden, undeferred->grad_hidden), tol.dh) << i;
  }

  auto again = RunStashed(**backend, batches, c.capacity, budget);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(std::memcmp(again->grad_weight.data(), run->grad_weight.data(),
                        run->grad_weight.size() * sizeof(float)),
            0);
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_EQ(again->microbatches[i].grad_hidden, run->microbatches[i].grad_hidden) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGradStashTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

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
}

}  // namespace
}  // namespace losshead::kernels
