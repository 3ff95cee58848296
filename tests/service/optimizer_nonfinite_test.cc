// A gradient window that holds NaN or Inf, from finite inputs: hidden states so large that dW
// overflows, or a W whose logits overflow. The policy is the proto's (ApplyOptimizerRequest): the
// apply is FAILED_PRECONDITION and changes nothing (W, the fp32 master copy, the optimizer's
// state and step count, the weights version, the step key), and the window stays whole for a
// pull to inspect. A pull with reset drops it, and training goes on as if the poisoned
// micro-batches had never been sent: the next apply matches a float64 AdamW that never saw them.
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

  // One micro-batch whose dW is not finite; its step itself is answered.
  void StepPoison() {
    HostBatch batch = MakeBatch(kTokens, kD, kV, v1::DTYPE_FP32, /*seed=*/404);
    if (GetParam().poison == Poison::kHugeHidden) {
      batch.hidden.assign(kTokens * kD, 1e38f);
      batch.hidden_bytes = Encode(batch.hidden, v1::DTYPE_FP32);
    }
    client::Microbatch mb = ToMicrobatch(head_, "poison", 1, batch);
    mb.options.set_reduction(v1::REDUCTION_SUM);
    auto r = client_->Step(mb);
    ASSERT_TRUE(r.ok()) << r.status();
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

TEST_P(OptimizerNonFiniteTest, ApplyIsRefusedAndChangesNothing) {
  const Case& c = GetParam();
  head_ = "nonfinite-" + CaseName(c);
  auto known = CreateKnownHead(*client_, head_, kV, kD, c.dtype, /*seed=*/21, /*std=*/0.3);
  ASSERT_TRUE(known.ok()) << known.status();
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client_->SetOptimizer(head_, adamw).ok());
  ref_ = std::make_unique<RefOptimizer>(
      v1::OPTIMIZER_ADAMW, std::vector<double>(known->weight.begin(), known->weight.end()));
  // One clean step first, so that the state an apply must not touch is not all zeros.
  ASSERT_NO_FATAL_FAILURE(CleanStep(1));

  // The window: a clean micro-batch, then the poisoned one.
  ASSERT_TRUE(FillWindow(*client_, head_, kV, kD, "clean", &sequence_, 1, kTokens).ok());
  if (c.poison == Poison::kOverflowingLogits) ASSERT_NO_FATAL_FAILURE(PushOverflowingRow());
  ASSERT_NO_FATAL_FAILURE(StepPoison());
  const State before = Now();
  ASSERT_EQ(before.microbatches_since_pull, 2u);
  size_t non_finite = 0;
  for (float g : Decode(before.gradient, v1::DTYPE_FP32)) non_finite += !std::isfinite(g);
  ASSERT_GT(non_finite, 0u) << "the poisoned micro-batch left dW finite: the test tests nothing";

  // Refused whatever the request asks: plain, clipped (the coefficient of an infinite norm would
  // be 0, and 0 x Inf is NaN), or with a divisor of its own.
  std::vector<v1::ApplyOptimizerRequest> requests(3, ApplyRequest(head_, "t", 2, params_));
  requests[1].set_max_norm(1.0);
  requests[1].set_trunk_grad_sq_norm(0.5);
  requests[2].set_grad_divisor(1e6);
  for (const v1::ApplyOptimizerRequest& r : requests) {
    auto applied = client_->ApplyOptimizer(r);
    EXPECT_EQ(applied.status().code(), absl::StatusCode::kFailedPrecondition)
        << r.ShortDebugString() << ": " << applied.status();
    EXPECT_NE(applied.status().message().find("NaN or Inf"), std::string::npos) << applied.status();
    EXPECT_TRUE(Same(Now(), before)) << r.ShortDebugString();
  }

  // A pull with reset hands the whole window over, poison included, and empties it.
  auto dropped = client_->PullGradient(head_, v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->summary.microbatch_count(), 2u);
  EXPECT_EQ(dropped->summary.token_count(), before.tokens_since_pull);
  EXPECT_EQ(dropped->data, before.gradient);
  auto info = client_->GetHead(head_);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_since_pull(), 0u);
  EXPECT_EQ(info->optimizer_step(), 1u);
  if (c.poison == Poison::kOverflowingLogits) {
    // The trainer puts its W back (a push: the master copy is taken from W again, the state and
    // step count stay).
    auto version = client_->PushWeights(
        {.head = head_, .dtype = c.dtype, .data = Encode(sane_weights_, c.dtype)});
    ASSERT_TRUE(version.ok()) << version.status();
    ref_->SetParams(std::vector<double>(sane_weights_.begin(), sane_weights_.end()));
  }

  // The refused key was not used up, and the state and step count are those of one apply: the
  // next step matches the reference's second.
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
  batch.hidden.assign(kTokens * kD, 1e37f);
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
  const double divisor = 0.01;
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
