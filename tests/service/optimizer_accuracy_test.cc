// The server-side optimizer against an independent float64 AdamW / SGD fed the same gradients
// (the window read back before each apply), and its clipping against clip_grad_norm_'s formula.
#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 29;
constexpr int64_t kD = 12;
constexpr int kMicrobatches = 2;
constexpr int64_t kTokens = 16;

struct Case {
  std::string name;
  v1::OptimizerKind kind;
  bool momentum_buffer;
  v1::OptimizerHyperParams params;  // lr scaled by a decaying schedule per step
};

class OptimizerAccuracyTest : public SharedServerTest<>,
                              public ::testing::WithParamInterface<Case> {};

TEST_P(OptimizerAccuracyTest, TwentyStepsMatchFloat64Reference) {
  const Case& c = GetParam();
  const std::string head = "acc-" + c.name;
  auto known = CreateKnownHead(*client_, head, kV, kD, v1::DTYPE_FP32, 11);
  ASSERT_TRUE(known.ok()) << known.status();
  v1::OptimizerSpec spec;
  spec.set_kind(c.kind);
  spec.set_momentum_buffer(c.momentum_buffer);
  auto set = client_->SetOptimizer(head, spec);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->spec().optimizer().kind(), c.kind);
  EXPECT_EQ(set->optimizer_step(), 0u);

  RefOptimizer ref(c.kind, std::vector<double>(known->weight.begin(), known->weight.end()));
  uint64_t sequence = 0;
  uint64_t version = known->version;
  for (int step = 1; step <= 20; ++step) {
    auto raw = FillWindow(*client_, head, kV, kD, "acc", &sequence, kMicrobatches, kTokens);
    ASSERT_TRUE(raw.ok()) << raw.status();
    v1::OptimizerHyperParams params = c.params;
    params.set_lr(c.params.lr() * (1.0 - step / 40.0));  // a schedule lives in the trainer
    v1::ApplyOptimizerRequest request = ApplyRequest(head, "acc", step, params);
    request.set_expected_weights_version(version);
    auto applied = client_->ApplyOptimizer(request);
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_FALSE(applied->replayed());
    EXPECT_EQ(applied->window().token_count(), kMicrobatches * kTokens);
    EXPECT_EQ(applied->window().microbatch_count(), kMicrobatches);
    EXPECT_EQ(applied->window().min_weights_version(), version);
    EXPECT_EQ(applied->weights_version(), version + 1);
    EXPECT_EQ(applied->optimizer_step(), static_cast<uint64_t>(step));
    EXPECT_EQ(applied->clip_coefficient(), 1.0);
    version = applied->weights_version();

    std::vector<double> grad(raw->size());
    double squared = 0;
    for (size_t i = 0; i < grad.size(); ++i) {
      grad[i] = (*raw)[i] / static_cast<double>(kMicrobatches * kTokens);
      squared += grad[i] * grad[i];
    }
    EXPECT_NEAR(applied->head_grad_norm(), std::sqrt(squared), 1e-6 * std::sqrt(squared));
    ref.Step(grad, params);
  }
  auto weights = Weights(*client_, head);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(AllClose(*weights, ref.params(), 1e-6));
  // The apply zeroed dW and emptied the window.
  auto info = client_->GetHead(head);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_since_pull(), 0u);
  EXPECT_EQ(info->optimizer_step(), 20u);
  EXPECT_EQ(info->weights_version(), version);
  auto dw = client_->PullGradient(head);
  ASSERT_TRUE(dw.ok());
  for (float g : Decode(dw->data, v1::DTYPE_FP32)) ASSERT_EQ(g, 0.0f);
  ASSERT_TRUE(client_->DeleteHead(head).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, OptimizerAccuracyTest,
    ::testing::Values(
        Case{"adamw", v1::OPTIMIZER_ADAMW, false, AdamWParams(0.01, 0.05)},
        Case{"sgd_nesterov_wd", v1::OPTIMIZER_SGD, true, SgdParams(0.3, 0.9, 0.0, true, 0.01)},
        Case{"sgd_dampening", v1::OPTIMIZER_SGD, true, SgdParams(0.3, 0.5, 0.25, false, 0.0)},
        Case{"sgd_plain", v1::OPTIMIZER_SGD, false, SgdParams(0.5, 0.0, 0.0, false, 0.02)}),
    [](const auto& info) { return info.param.name; });

using OptimizerClipTest = SharedServerTest<>;

TEST_F(OptimizerClipTest, CoefficientIsClipGradNormsOverHeadAndTrunk) {
  const std::string head = "clip";
  auto known = CreateKnownHead(*client_, head, kV, kD, v1::DTYPE_FP32, 5);
  ASSERT_TRUE(known.ok()) << known.status();
  v1::OptimizerSpec spec;
  spec.set_kind(v1::OPTIMIZER_SGD);
  ASSERT_TRUE(client_->SetOptimizer(head, spec).ok());
  std::vector<float> w = known->weight;
  uint64_t sequence = 0;
  // max_norm below the total norm: clipped; far above it: coefficient exactly 1.
  for (const double fraction : {0.25, 100.0}) {
    auto raw = FillWindow(*client_, head, kV, kD, "clip", &sequence, 3, kTokens);
    ASSERT_TRUE(raw.ok()) << raw.status();
    const double divisor = 40.0;  // a caller's divisor instead of the window's tokens
    double head_sq = 0;
    for (float g : *raw) head_sq += (g / divisor) * (g / divisor);
    const double trunk_sq = 2.5 * head_sq;
    const double max_norm = fraction * std::sqrt(head_sq + trunk_sq);
    v1::ApplyOptimizerRequest request =
        ApplyRequest(head, "clip", sequence, SgdParams(1.0, 0, 0, false, 0));
    request.set_grad_divisor(divisor);
    request.set_max_norm(max_norm);
    request.set_trunk_grad_sq_norm(trunk_sq);
    auto applied = client_->ApplyOptimizer(request);
    ASSERT_TRUE(applied.ok()) << applied.status();
    const double want = ClipCoefficient(head_sq + trunk_sq, max_norm);
    EXPECT_NEAR(applied->clip_coefficient(), want, 1e-12 * want) << fraction;
    if (fraction > 1) EXPECT_EQ(applied->clip_coefficient(), 1.0);
    EXPECT_NEAR(applied->head_grad_norm(), std::sqrt(head_sq), 1e-12 * std::sqrt(head_sq));
    EXPECT_NEAR(applied->total_grad_norm(), std::sqrt(head_sq + trunk_sq),
                1e-12 * std::sqrt(head_sq + trunk_sq));
    // SGD with lr 1: W moved by exactly the clipped, divided gradient.
    std::vector<double> expected(w.size());
    for (size_t i = 0; i < w.size(); ++i) expected[i] = w[i] - want * (*raw)[i] / divisor;
    auto weights = Weights(*client_, head);
    ASSERT_TRUE(weights.ok());
    EXPECT_TRUE(AllClose(*weights, expected, 1e-6));
    w = *weights;
  }
  ASSERT_TRUE(client_->DeleteHead(head).ok());
}

}  // namespace
}  // namespace losshead::testing
