// The CPU backend's optimizer step against the float64 reference: 20 steps of every optimizer,
// variant, dtype and shape on fresh random weights and gradients.
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "tests/kernels/optimizer_runner.h"
#include "tests/kernels/reference_optimizer.h"

namespace losshead::kernels {
namespace {

using testing::OptimizerCase;

class CpuOptimizerTest : public ::testing::TestWithParam<OptimizerCase> {};

TEST_P(CpuOptimizerTest, TwentyStepsMatchFloat64Reference) {
  const OptimizerCase& c = GetParam();
  const testing::OptimizerInputs in = testing::MakeOptimizerInputs(c, /*seed=*/1234);
  std::unique_ptr<Backend> backend = CreateCpuBackend(3);
  testing::OptimizerOutputs got;
  ASSERT_TRUE(testing::RunOptimizerSteps(*backend, c, in, &got).ok());

  testing::ReferenceOptimizerState want;
  // The master (or the fp32 weights) starts as the generated fp32 values.
  want.param.assign(in.param.begin(), in.param.end());
  for (int step = 1; step <= c.steps; ++step) {
    testing::ReferenceOptimizerStep(c.options, c.grad_scale, step, in.grads[step - 1], &want);
  }
  EXPECT_LE(testing::ScaledMaxError(got.param, want.param), c.tolerance) << "parameters";
  const OptimizerKind kind = KindOf(c.options);
  const bool has_a = kind != OptimizerKind::kSgd || std::get<SgdOptions>(c.options).momentum != 0;
  if (has_a) EXPECT_LE(testing::ScaledMaxError(got.state_a, want.a), c.tolerance) << "state a";
  if (kind == OptimizerKind::kAdamW) {
    EXPECT_LE(testing::ScaledMaxError(got.state_b, want.b), c.tolerance) << "state b";
  }
  // The weights are the master rounded to nearest-even, bit for bit.
  std::vector<uint8_t> rounded(got.weight.size());
  FromFloat(c.dtype, got.param.data(), rounded.data(), got.param.size());
  EXPECT_EQ(got.weight, rounded);
  for (float g : got.grad) ASSERT_EQ(g, 0.0f) << "dW is zeroed by the step";
}

TEST_P(CpuOptimizerTest, ThreadCountAndAlignmentChangeNoBit) {
  OptimizerCase c = GetParam();
  c.steps = 3;
  const testing::OptimizerInputs in = testing::MakeOptimizerInputs(c, /*seed=*/99);
  testing::OptimizerOutputs one, many;
  ASSERT_TRUE(testing::RunOptimizerSteps(*CreateCpuBackend(1), c, in, &one).ok());
  ASSERT_TRUE(testing::RunOptimizerSteps(*CreateCpuBackend(4), c, in, &many, /*offset=*/1).ok());
  EXPECT_EQ(std::memcmp(one.param.data(), many.param.data(), one.param.size() * 4), 0);
  EXPECT_EQ(one.weight, many.weight);
  EXPECT_EQ(std::memcmp(one.state_a.data(), many.state_a.data(), one.state_a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(one.state_b.data(), many.state_b.data(), one.state_b.size() * 4), 0);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CpuOptimizerTest,
                         ::testing::ValuesIn(testing::StandardOptimizerCases()),
                         [](const ::testing::TestParamInfo<OptimizerCase>& info) {
                           return info.param.name;
                         });

TEST(CpuOptimizerTest, SgdMomentumBufferStartsAsTheFirstGradient) {
  OptimizerCase c;
  c.options = SgdOptions{.lr = 0.5f, .momentum = 0.9f, .dampening = 0.5f};
  c.rows = 3;
  c.cols = 5;
  c.steps = 1;
  const testing::OptimizerInputs in = testing::MakeOptimizerInputs(c, 7);
  testing::OptimizerOutputs got;
  ASSERT_TRUE(testing::RunOptimizerSteps(*CreateCpuBackend(2), c, in, &got).ok());
  // torch clones d_p into a new buffer: no dampening on the first step.
  for (int64_t i = 0; i < c.count(); ++i) {
    EXPECT_EQ(got.state_a[i], in.grads[0][i] * c.grad_scale);
    EXPECT_EQ(got.param[i], in.param[i] + -0.5f * got.state_a[i]);
  }
}

TEST(OptimizerMemoryTest, StateBytesCountMasterAndMoments) {
  EXPECT_EQ(StateBufferCount(OptimizerKind::kAdamW), 2);
  EXPECT_EQ(StateBufferCount(OptimizerKind::kSgd), 1);
  EXPECT_EQ(StateBufferCount(OptimizerKind::kLion), 1);
  const int64_t count = int64_t{128256} * 4096;
  // The design's figure for bf16 AdamW: fp32 master + two moments, 6 GiB at V x D = 525 M.
  EXPECT_EQ(OptimizerStateBytes(OptimizerKind::kAdamW, DType::kBF16, count), 12ull * count);
  EXPECT_EQ(OptimizerStateBytes(OptimizerKind::kAdamW, DType::kFP32, count), 8ull * count);
  EXPECT_EQ(OptimizerStateBytes(OptimizerKind::kSgd, DType::kFP16, count), 8ull * count);
  EXPECT_EQ(OptimizerStateBytes(OptimizerKind::kLion, DType::kFP32, count), 4ull * count);
  EXPECT_EQ(KindOf(OptimizerOptions{SgdOptions{}}), OptimizerKind::kSgd);
  EXPECT_EQ(OptimizerKindName(KindOf(OptimizerOptions{})), "adamw");
}

}  // namespace
}  // namespace losshead::kernels
