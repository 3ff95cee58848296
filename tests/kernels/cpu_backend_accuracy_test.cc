// The CPU backend against the float64 reference on fresh random inputs, every dtype and option.
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/reference_loss.h"

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
using testing::ToDouble;
using testing::WorstToleranceRatio;

// Tolerances relative to the float64 reference on the same rounded inputs. The backend's math is
// fp32 (GEMMs with fp32 accumulation, double row reductions), so loss, lse and dW carry fp32-level
// error whatever the dtype; dH is additionally rounded once to the problem's dtype. Element-wise
// checks are |actual - expected| <= rel * |expected| + abs, with abs a fraction of the tensor's
// largest magnitude so that near-zero entries (cancellation in the sums) are judged at its scale.
struct Tolerance {
  double loss_rel = 1e-6;         // per-token loss, lse and loss_sum, relative to |value| + 1
  double grad_weight_rel = 1e-5;  // plus 1e-6 of the largest |dW|
  double grad_hidden_rel;         // one ulp of the dtype (rounding costs at most half of one)
  double grad_hidden_abs;         // plus 1e-6 of the largest |dH|, plus this (fp16 subnormal step)
};

Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return {.grad_hidden_rel = 0x1p-7, .grad_hidden_abs = 0.0};
    case DType::kFP16:
      return {.grad_hidden_rel = 0x1p-10, .grad_hidden_abs = 0x1p-24};
    case DType::kFP32:
      return {.grad_hidden_rel = 1e-5, .grad_hidden_abs = 0.0};
  }
  return {};
}

// Checks every output of one call; `grad_weight_before` is the accumulator before the call.
void ExpectMatchesReference(const Problem& p, const Outputs& out, const ReferenceResult& ref,
                            const std::vector<float>& grad_weight_before, const Tolerance& tol) {
  EXPECT_EQ(out.token_count, ref.token_count);
  EXPECT_NEAR(out.loss_sum, ref.loss_sum, tol.loss_rel * (std::fabs(ref.loss_sum) + p.n));
  EXPECT_LE(WorstToleranceRatio(ToDouble(out.per_token_loss), ref.per_token_loss, tol.loss_rel,
                                tol.loss_rel),
            1.0)
      << "per_token_loss";
  EXPECT_LE(WorstToleranceRatio(ToDouble(out.per_token_lse), ref.per_token_lse, tol.loss_rel,
                                tol.loss_rel),
            1.0)
      << "per_token_lse";
  for (int64_t t = 0; t < p.n; ++t) {
    if (ref.per_token_loss[t] == 0.0) EXPECT_EQ(out.per_token_loss[t], 0.0f) << "token " << t;
  }
  const double dh_abs = 1e-6 * MaxAbs(ref.grad_hidden) + tol.grad_hidden_abs;
  EXPECT_LE(WorstToleranceRatio(out.grad_hidden, ref.grad_hidden, tol.grad_hidden_rel, dh_abs), 1.0)
      << "grad_hidden";
  std::vector<double> expected_dw = ref.grad_weight;
  if (!grad_weight_before.empty()) {
    for (size_t i = 0; i < expected_dw.size(); ++i) expected_dw[i] += grad_weight_before[i];
  }
  EXPECT_LE(WorstToleranceRatio(ToDouble(out.grad_weight), expected_dw, tol.grad_weight_rel,
                                1e-6 * MaxAbs(expected_dw)),
            1.0)
      << "grad_weight";
}

struct Case {
  std::string name;
  int64_t n, d, v;
  DType dtype;
  LossOptions options;
  InputSpec spec;
};

class CpuBackendAccuracyTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuBackendAccuracyTest, MatchesFloat64Reference) {
  const Case& c = GetParam();
  const Problem p{.n = c.n, .d = c.d, .v = c.v, .dtype = c.dtype, .options = c.options};
  const Inputs in = MakeRandomInputs(p, std::hash<std::string>()(c.name), c.spec);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, {});
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(p, *out, ReferenceLoss(p, in.hidden, in.weight, in.targets), {},
                         ToleranceFor(c.dtype));
}

LossOptions Options(Reduction reduction, float grad_scale = 1.0f, float label_smoothing = 0.0f,
                    float z_loss = 0.0f, float softcap = 0.0f, int64_t ignore_index = -100) {
  return {.ignore_index = ignore_index,
          .reduction = reduction,
          .grad_scale = grad_scale,
          .label_smoothing = label_smoothing,
          .z_loss = z_loss,
          .softcap = softcap};
}

// Logits of a few units: h, w ~ U(-1, 1) over D = 67 gives |x| around 3.
const InputSpec kUnit{.hidden_scale = 1.0, .weight_scale = 0.7};
const InputSpec kUnitIgnore{.hidden_scale = 1.0, .weight_scale = 0.7, .ignore_fraction = 0.3};

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuBackendAccuracyTest,
    ::testing::Values(
        Case{"BF16_N1_D67_V1000_Mean", 1, 67, 1000, DType::kBF16, Options(Reduction::kMean), kUnit},
        Case{"FP16_N1_D67_V997_Sum", 1, 67, 997, DType::kFP16, Options(Reduction::kSum), kUnit},
        Case{"FP32_N37_D67_V997_None", 37, 67, 997, DType::kFP32, Options(Reduction::kNone), kUnit},
        Case{"BF16_N64_D67_V997_Sum", 64, 67, 997, DType::kBF16, Options(Reduction::kSum), kUnit},
        Case{"FP16_N64_D67_V1000_Mean", 64, 67, 1000, DType::kFP16, Options(Reduction::kMean),
             kUnit},
        Case{"BF16_N64_D67_V997_Mean_IgnoreIndex", 64, 67, 997, DType::kBF16,
             Options(Reduction::kMean), kUnitIgnore},
        Case{"FP32_N40_D33_V1000_Sum_IgnoreIndexInsideVocab", 40, 33, 1000, DType::kFP32,
             Options(Reduction::kSum, 1.0f, 0.0f, 0.0f, 0.0f, /*ignore_index=*/5), kUnitIgnore},
        Case{"BF16_N48_D67_V1000_Mean_LabelSmoothing", 48, 67, 1000, DType::kBF16,
             Options(Reduction::kMean, 1.0f, 0.1f), kUnit},
        Case{"FP16_N48_D67_V997_Sum_ZLoss", 48, 67, 997, DType::kFP16,
             Options(Reduction::kSum, 1.0f, 0.0f, 0.05f), kUnit},
        Case{"FP32_N48_D67_V1000_Mean_Softcap", 48, 67, 1000, DType::kFP32,
             Options(Reduction::kMean, 1.0f, 0.0f, 0.0f, 4.0f), kUnit},
        Case{"BF16_N48_D67_V1000_None_Softcap", 48, 67, 1000, DType::kBF16,
             Options(Reduction::kNone, 1.0f, 0.0f, 0.0f, 2.5f), kUnit},
        Case{"FP32_N48_D67_V997_Sum_GradScale", 48, 67, 997, DType::kFP32,
             Options(Reduction::kSum, 0.37f), kUnit},
        Case{"BF16_N48_D67_V997_Mean_GradScale", 48, 67, 997, DType::kBF16,
             Options(Reduction::kMean, 1024.0f), kUnit},
        Case{"FP16_N50_D67_V1000_Mean_AllOptions", 50, 67, 1000, DType::kFP16,
             Options(Reduction::kMean, 2.5f, 0.2f, 0.01f, 3.0f), kUnitIgnore},
        Case{"BF16_N50_D128_V1000_Sum_AllOptions", 50, 128, 1000, DType::kBF16,
             Options(Reduction::kSum, 0.5f, 0.05f, 1e-3f, 30.0f), kUnitIgnore}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Logits around +-1e4 with the soft-cap off: the max must be subtracted before exponentiating.
// fp32 logits that large are themselves only good to ~1e-3 absolute (an ulp of 1e4), so loss and
// lse are checked to a few ulps of the logits' magnitude; gradients with the usual tolerances.
TEST(CpuBackendLargeLogitsTest, FP32AndBF16_N32_D67_V1000_LogitsAround1e4) {
  for (DType dtype : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Problem p{
        .n = 32, .d = 67, .v = 1000, .dtype = dtype, .options = Options(Reduction::kSum)};
    const Inputs in = MakeRandomInputs(p, 77, {.hidden_scale = 100.0, .weight_scale = 50.0});
    const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
    ASSERT_GT(MaxAbs(ref.per_token_lse), 5e3);  // the case really has huge logits
    std::unique_ptr<Backend> backend = CreateCpuBackend(2);
    absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, {});
    ASSERT_TRUE(out.ok()) << out.status();
    const double logit_scale = MaxAbs(ref.per_token_lse);
    EXPECT_LE(WorstToleranceRatio(ToDouble(out->per_token_lse), ref.per_token_lse, 0.0,
                                  2e-6 * logit_scale),
              1.0);
    EXPECT_LE(WorstToleranceRatio(ToDouble(out->per_token_loss), ref.per_token_loss, 0.0,
                                  2e-6 * logit_scale),
              1.0);
    EXPECT_NEAR(out->loss_sum, ref.loss_sum, 2e-6 * logit_scale * p.n);
    EXPECT_LE(
        WorstToleranceRatio(out->grad_hidden, ref.grad_hidden, ToleranceFor(dtype).grad_hidden_rel,
                            1e-6 * MaxAbs(ref.grad_hidden)),
        1.0);
    EXPECT_LE(WorstToleranceRatio(ToDouble(out->grad_weight), ref.grad_weight, 1e-5,
                                  1e-6 * MaxAbs(ref.grad_weight)),
              1.0);
  }
}

TEST(CpuBackendIgnoreTest, BF16_N8_D67_V1000_AllTargetsIgnored) {
  for (Reduction reduction : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    const Problem p{
        .n = 8, .d = 67, .v = 1000, .dtype = DType::kBF16, .options = Options(reduction)};
    const Inputs in = MakeRandomInputs(p, 5, {.ignore_fraction = 1.0});
    const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
    std::vector<float> dw_before(p.v * p.d);
    for (size_t i = 0; i < dw_before.size(); ++i)
      dw_before[i] = 0.001f * static_cast<float>(i % 97);
    std::unique_ptr<Backend> backend = CreateCpuBackend(2);
    absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, {.initial_grad_weight = dw_before});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->loss_sum, 0.0f);
    EXPECT_EQ(out->token_count, 0);
    for (double g : out->grad_hidden) ASSERT_EQ(g, 0.0);
    EXPECT_EQ(out->grad_weight, dw_before);
    for (int64_t t = 0; t < p.n; ++t) {
      EXPECT_EQ(out->per_token_loss[t], 0.0f);
      EXPECT_NEAR(out->per_token_lse[t], ref.per_token_lse[t], 1e-6 * (1 + ref.per_token_lse[t]));
    }
  }
}

TEST(CpuBackendAccumulateTest, BF16_N20_D67_V997_GradWeightAddsAcrossTwoCalls) {
  const Problem p{
      .n = 20, .d = 67, .v = 997, .dtype = DType::kBF16, .options = Options(Reduction::kMean)};
  const Inputs first = MakeRandomInputs(p, 11, kUnit);
  const Inputs second = MakeRandomInputs(p, 12, kUnit);
  std::vector<float> dw0(p.v * p.d);
  for (size_t i = 0; i < dw0.size(); ++i) dw0[i] = 1e-3f * static_cast<float>(i % 13) - 6e-3f;
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> after_first = RunOnBackend(*backend, first, {.initial_grad_weight = dw0});
  ASSERT_TRUE(after_first.ok()) << after_first.status();
  absl::StatusOr<Outputs> after_second =
      RunOnBackend(*backend, second, {.initial_grad_weight = after_first->grad_weight});
  ASSERT_TRUE(after_second.ok()) << after_second.status();

  const ReferenceResult ref1 = ReferenceLoss(p, first.hidden, first.weight, first.targets);
  const ReferenceResult ref2 = ReferenceLoss(p, second.hidden, second.weight, second.targets);
  std::vector<double> expected(dw0.size());
  for (size_t i = 0; i < dw0.size(); ++i)
    expected[i] = dw0[i] + ref1.grad_weight[i] + ref2.grad_weight[i];
  EXPECT_LE(WorstToleranceRatio(ToDouble(after_second->grad_weight), expected, 1e-5,
                                1e-6 * MaxAbs(expected)),
            1.0);
}

// Budgets so small that the chunk is a few tokens and W is converted a few rows at a time must
// give the same result as one big chunk.
TEST(CpuBackendChunkingTest, AllDTypes_N70_D67_V997_TinyWorkspaceMatchesLarge) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Problem p{.n = 70,
                    .d = 67,
                    .v = 997,
                    .dtype = dtype,
                    .options = Options(Reduction::kMean, 1.0f, 0.1f, 1e-3f, 0.0f)};
    const Inputs in = MakeRandomInputs(p, 21, kUnitIgnore);
    std::unique_ptr<Backend> backend = CreateCpuBackend(2);
    // The smallest budget the backend accepts, then a little more than it.
    size_t lo = 1, hi = size_t{1} << 30;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      if (backend->WorkspaceBytes(p, mid).ok())
        hi = mid;
      else
        lo = mid + 1;
    }
    absl::StatusOr<size_t> big = backend->WorkspaceBytes(p, size_t{1} << 30);
    ASSERT_TRUE(big.ok());
    ASSERT_LT(3 * lo, *big);  // the tiny budgets really are tiny
    const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
    absl::StatusOr<Outputs> large = RunOnBackend(*backend, in, {.workspace_budget = *big});
    ASSERT_TRUE(large.ok()) << large.status();
    for (size_t budget : {lo, lo + lo / 2, 3 * lo}) {
      SCOPED_TRACE(budget);
      absl::StatusOr<Outputs> tiny = RunOnBackend(*backend, in, {.workspace_budget = budget});
      ASSERT_TRUE(tiny.ok()) << tiny.status();
      ExpectMatchesReference(p, *tiny, ref, {}, ToleranceFor(dtype));
      EXPECT_EQ(tiny->token_count, large->token_count);
      EXPECT_NEAR(tiny->loss_sum, large->loss_sum, 1e-6 * std::fabs(large->loss_sum));
      EXPECT_LE(WorstToleranceRatio(ToDouble(tiny->grad_weight), ToDouble(large->grad_weight), 1e-5,
                                    1e-6 * MaxAbs(ToDouble(large->grad_weight))),
                1.0);
    }
  }
}

TEST(CpuBackendDeterminismTest, BF16_N600_D64_V1000_TwoRunsAreBitwiseEqual) {
  const Problem p{.n = 600,
                  .d = 64,
                  .v = 1000,
                  .dtype = DType::kBF16,
                  .options = Options(Reduction::kMean, 1.0f, 0.1f, 1e-3f, 20.0f)};
  const Inputs in = MakeRandomInputs(p, 31, kUnitIgnore);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> a = RunOnBackend(*backend, in, {});
  absl::StatusOr<Outputs> b = RunOnBackend(*backend, in, {});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss_sum, b->loss_sum);
  EXPECT_EQ(a->per_token_loss, b->per_token_loss);
  EXPECT_EQ(a->per_token_lse, b->per_token_lse);
  EXPECT_EQ(a->grad_hidden, b->grad_hidden);
  EXPECT_EQ(a->grad_weight, b->grad_weight);
}

// Backend methods are thread-safe: two callers running at once get what each gets alone.
TEST(CpuBackendConcurrencyTest, BF16_N300_D64_V1000_TwoThreadsMatchSequentialRuns) {
  const Problem p{
      .n = 300, .d = 64, .v = 1000, .dtype = DType::kBF16, .options = Options(Reduction::kSum)};
  const Inputs first = MakeRandomInputs(p, 51, kUnit);
  const Inputs second = MakeRandomInputs(p, 52, kUnitIgnore);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> alone_first = RunOnBackend(*backend, first, {});
  absl::StatusOr<Outputs> alone_second = RunOnBackend(*backend, second, {});
  ASSERT_TRUE(alone_first.ok() && alone_second.ok());
  absl::StatusOr<Outputs> together_first, together_second;
  std::thread other([&] { together_second = RunOnBackend(*backend, second, {}); });
  together_first = RunOnBackend(*backend, first, {});
  other.join();
  ASSERT_TRUE(together_first.ok() && together_second.ok());
  EXPECT_EQ(together_first->grad_hidden, alone_first->grad_hidden);
  EXPECT_EQ(together_first->grad_weight, alone_first->grad_weight);
  EXPECT_EQ(together_first->loss_sum, alone_first->loss_sum);
  EXPECT_EQ(together_second->grad_hidden, alone_second->grad_hidden);
  EXPECT_EQ(together_second->grad_weight, alone_second->grad_weight);
  EXPECT_EQ(together_second->loss_sum, alone_second->loss_sum);
}

TEST(CpuBackendOptionalOutputsTest, FP16_N16_D67_V997_LossWithoutGradientsOrPerToken) {
  const Problem p{.n = 16,
                  .d = 67,
                  .v = 997,
                  .dtype = DType::kFP16,
                  .options = Options(Reduction::kSum, 1.0f, 0.1f, 1e-2f, 5.0f)};
  const Inputs in = MakeRandomInputs(p, 41, kUnitIgnore);
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  for (const RunOptions& options :
       {RunOptions{.grad_hidden = false, .grad_weight = false, .per_token = false},
        RunOptions{.grad_hidden = true, .grad_weight = false, .per_token = false},
        RunOptions{.grad_hidden = false, .grad_weight = true, .per_token = true}}) {
    absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, options);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->token_count, ref.token_count);
    EXPECT_NEAR(out->loss_sum, ref.loss_sum, 1e-6 * (std::fabs(ref.loss_sum) + p.n));
    if (options.grad_hidden) {
      EXPECT_LE(WorstToleranceRatio(out->grad_hidden, ref.grad_hidden, 0x1p-10,
                                    1e-6 * MaxAbs(ref.grad_hidden) + 0x1p-24),
                1.0);
    }
    if (options.grad_weight) {
      EXPECT_LE(WorstToleranceRatio(ToDouble(out->grad_weight), ref.grad_weight, 1e-5,
                                    1e-6 * MaxAbs(ref.grad_weight)),
                1.0);
    }
  }
}

}  // namespace
}  // namespace losshead::kernels
