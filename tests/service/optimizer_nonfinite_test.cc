// Finite inputs that would put NaN or Inf in the gradient window: hidden states so large that dW
// overflows, or a W whose logits overflow. The micro-batch is refused at the step (OUT_OF_RANGE,
// see the proto's StepRequest) and changes nothing: the window, its counters, W and the
// optimizer stay as they were, and training goes on as if it had never been sent: the next apply
// matches a float64 AdamW that never saw it. A window that is finite but overflows once divided
// by the apply's grad_divisor is refused by the apply itself (FAILED_PRECONDITION).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 17;
constexpr int64_t kD = 8;
constexpr int64_t kTokens = 8;
constexpr int kCleanMicrobatches = 2;

enum class Poison {
  // Every token's hidden state is 1e38 (finite in fp32 and bf16): all tokens pick the same
  // largest logit, each adds about 1e38 to that row of dW, and the sum overflows fp32.
  kHugeHidden,
  // One row of W is 3e38 (finite): its logit overflows for ordinary hidden states, and softmax
  // turns the overflow into NaN.
  kOverflowingLogits,
};

struct Case {
  v1::DType dtype;
  Poison poison;
};

std::string CaseName(const Case& c) {
  return v1::DType_Name(c.dtype) +
         (c.poison == Poison::kHugeHidden ? "_HugeHidden" : "_OverflowingLogits");
}

class OptimizerNonFiniteTest : public SharedServerTest<>,
                               public ::testing::WithParamInterface<Case> {
 protected:
  // Everything an apply may change, and the window's bytes.
  struct State {
    std::vector<float> weights;
    uint64_t version, tokens_since_pull, microbatches_since_pull, optimizer_step;
    client::Bytes gradient;
    bool operator==(const State&) const = default;
  };
  State Now() {
    auto w = Weights(*client_, head_);
    auto info = client_->GetHead(head_);
    auto dw = client_->PullGradient(head_, v1::DTYPE_FP32, /*reset=*/false);
    EXPECT_TRUE(w.ok() && info.ok() && dw.ok());
    if (!w.ok() || !info.ok() || !dw.ok()) return {};
    return {*w,
            info->weights_version(),
            info->tokens_since_pull(),
            info->microbatches_since_pull(),
            info->optimizer_step(),
            dw->data};
  }
  // Bit for bit, NaN included (== on the floats would never hold for a NaN).
  static bool Same(const State& a, const State& b) {
    return a.version == b.version && a.tokens_since_pull == b.tokens_since_pull &&
           a.microbatches_since_pull == b.microbatches_since_pull &&
           a.optimizer_step == b.optimizer_step && a.gradient == b.gradient &&
           Encode(a.weights, v1::DTYPE_FP32) == Encode(b.weights, v1::DTYPE_FP32);
  }

  // Fills a clean window, applies `key` on the server and the reference alike.
  void CleanStep(uint64_t key) {
    auto raw =
        FillWindow(*client_, head_, kV, kD, "clean", &sequence_, kCleanMicrobatches, kTokens);
    ASSERT_TRUE(raw.ok()) << raw.status();
    auto applied = client_->ApplyOptimizer(ApplyRequest(head_, "t", key, params_));
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_FALSE(applied->replayed());
    EXPECT_EQ(applied->optimizer_step(), key);
    std::vector<double> grad(raw->size());
    const double tokens = static_cast<double>(kCleanMicrobatches * kTokens);
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = (*raw)[i] / tokens;
    ref_->Step(grad, params_);
  }

  // One micro-batch whose results would not be finite: refused before it runs.
  void StepPoison() {
    HostBatch batch = MakeBatch(kTokens, kD, kV, v1::DTYPE_FP32, /*seed=*/404);
    if (GetParam().poison == Poison::kHugeHidden) {
      batch.hidden.assign(kTokens * kD, 1e38f);
      batch.hidden_bytes = Encode(batch.hidden, v1::DTYPE_FP32);
    }
    client::Microbatch mb = ToMicrobatch(head_, "poison", 1, batch);
    mb.options.set_reduction(v1::REDUCTION_SUM);
    auto r = client_->Step(mb);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange)
        << (r.ok() ? "answered OK, loss " + std::to_string(r->loss) : r.status().ToString());
  }

  // Pushes W with row 0 set to 3e38, keeping the sane W in sane_weights_.
  void PushOverflowingRow() {
    auto current = Weights(*client_, head_);
    ASSERT_TRUE(current.ok()) << current.status();
    sane_weights_ = *current;
    std::vector<float> w = *current;
    std::fill(w.begin(), w.begin() + kD, 3e38f);
    auto version = client_->PushWeights(
        {.head = head_, .dtype = GetParam().dtype, .data = Encode(w, GetParam().dtype)});
    ASSERT_TRUE(version.ok()) << version.status();
  }

  void TearDown() override {
    if (!head_.empty()) client_->DeleteHead(head_).IgnoreError();
  }

  std::string head_;
  uint64_t sequence_ = 0;
  v1::OptimizerHyperParams params_ = AdamWParams(0.05, 0.02);
  std::unique_ptr<RefOptimizer> ref_;
  std::vector<float> sane_weights_;
};

TEST_P(OptimizerNonFiniteTest, PoisonIsRefusedAtTheStepAndTheNextApplyNeverSeesIt) {
  const Case& c = GetParam();
  head_ = "nonfinite-" + CaseName(c);
  auto known = CreateKnownHead(*client_, head_, kV, kD, c.dtype, /*seed=*/21, /*std=*/0.3);
  ASSERT_TRUE(known.ok()) << known.status();
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client_->SetOptimizer(head_, adamw).ok());
  ref_ = std::make_unique<RefOptimizer>(
      v1::OPTIMIZER_ADAMW, std::vector<double>(known->weight.begin(), known->weight.end()));
  // One clean step first, so that the state the poison must not touch is not all zeros.
  ASSERT_NO_FATAL_FAILURE(CleanStep(1));

  if (c.poison == Poison::kOverflowingLogits) ASSERT_NO_FATAL_FAILURE(PushOverflowingRow());
  const State before = Now();
  ASSERT_NO_FATAL_FAILURE(StepPoison());
  EXPECT_TRUE(Same(Now(), before)) << "the refused micro-batch changed the head";
  if (c.poison == Poison::kOverflowingLogits) {
    // Every micro-batch against that W is refused alike; the trainer puts its W back (a push:
    // the master copy is taken from W again, the state and step count stay).
    auto version = client_->PushWeights(
        {.head = head_, .dtype = c.dtype, .data = Encode(sane_weights_, c.dtype)});
    ASSERT_TRUE(version.ok()) << version.status();
    ref_->SetParams(std::vector<double>(sane_weights_.begin(), sane_weights_.end()));
  }

  // The state and step count are those of one apply: the next step matches the reference's
  // second.
  ASSERT_NO_FATAL_FAILURE(CleanStep(2));
  auto weights = Weights(*client_, head_);
  ASSERT_TRUE(weights.ok());
  // fp32: the server's arithmetic alone; bf16: W is the rounded image of the master copy.
  const double tol = c.dtype == v1::DTYPE_FP32 ? 1e-6 : 1.0 / 256;
  EXPECT_TRUE(AllClose(*weights, ref_->params(), tol));
}

INSTANTIATE_TEST_SUITE_P(Windows, OptimizerNonFiniteTest,
                         ::testing::Values(Case{v1::DTYPE_FP32, Poison::kHugeHidden},
                                           Case{v1::DTYPE_BF16, Poison::kHugeHidden},
                                           Case{v1::DTYPE_FP32, Poison::kOverflowingLogits},
                                           Case{v1::DTYPE_BF16, Poison::kOverflowingLogits}),
                         [](const auto& info) { return CaseName(info.param); });

// A window that is finite but overflows fp32 once divided: the kernels step with dW x grad_scale
// (grad_scale = coefficient / divisor) in fp32, so a caller's grad_divisor below 1 can turn a
// finite dW near 1e38 into Inf, and AdamW's update into Inf / Inf = NaN. By the same policy the
// apply must be refused (FAILED_PRECONDITION) with nothing changed.
using OptimizerOverflowTest = SharedServerTest<>;

TEST_F(OptimizerOverflowTest, DividedWindowThatOverflowsFp32IsRefused) {
  const std::string head = "overflow";
  auto known = CreateKnownHead(*client_, head, kV, kD, v1::DTYPE_FP32, /*seed=*/22, /*std=*/0.3);
  ASSERT_TRUE(known.ok()) << known.status();
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client_->SetOptimizer(head, adamw).ok());
  HostBatch batch = MakeBatch(kTokens, kD, kV, v1::DTYPE_FP32, /*seed=*/405);
  // Finite in every micro-batch's bounds (its part of dW is at most 8 x 2 x 1e35), but near
  // fp32's range once divided by 1e-4.
  batch.hidden.assign(kTokens * kD, 1e35f);
  batch.hidden_bytes = Encode(batch.hidden, v1::DTYPE_FP32);
  client::Microbatch mb = ToMicrobatch(head, "big", 1, batch);
  mb.options.set_reduction(v1::REDUCTION_SUM);
  ASSERT_TRUE(client_->Step(mb).ok());
  auto dw = client_->PullGradient(head, v1::DTYPE_FP32, /*reset=*/false);
  ASSERT_TRUE(dw.ok());
  float largest = 0;
  for (float g : Decode(dw->data, v1::DTYPE_FP32)) {
    ASSERT_TRUE(std::isfinite(g));
    largest = std::max(largest, std::abs(g));
  }
  const double divisor = 1e-4;
  ASSERT_GT(largest / divisor, std::numeric_limits<float>::max()) << "the test tests nothing";
  auto before = client_->GetHead(head);
  ASSERT_TRUE(before.ok());

  v1::ApplyOptimizerRequest request = ApplyRequest(head, "t", 1, AdamWParams(0.05, 0.0));
  request.set_grad_divisor(divisor);
  auto applied = client_->ApplyOptimizer(request);
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kFailedPrecondition)
      << (applied.ok() ? applied->ShortDebugString() : applied.status().ToString());
  auto weights = Weights(*client_, head);
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(*weights, known->weight);
  auto after = client_->GetHead(head);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->weights_version(), before->weights_version());
  EXPECT_EQ(after->optimizer_step(), 0u);
  EXPECT_EQ(after->tokens_since_pull(), before->tokens_since_pull());
  auto kept = client_->PullGradient(head, v1::DTYPE_FP32, /*reset=*/false);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->data, dw->data);
  client_->DeleteHead(head).IgnoreError();
}

}  // namespace
}  // namespace losshead::testing
