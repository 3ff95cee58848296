// The server-side optimizer's contract through the client: exactly-once applies, every error path
// with its code and nothing changed, and its memory in HeadInfo.
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 17;
constexpr int64_t kD = 8;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

class OptimizerSemanticsTest : public SharedServerTest<> {
 protected:
  // A head with `kind` (SGD with its momentum buffer) and a window of 2 micro-batches.
  void Make(const std::string& name, v1::OptimizerKind kind, bool momentum_buffer = false) {
    head_ = name;
    v1::HeadSpec spec;
    spec.set_name(name);
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(v1::DTYPE_FP32);
    spec.mutable_init()->mutable_normal()->set_std(0.3f);
    spec.mutable_optimizer()->set_kind(kind);
    spec.mutable_optimizer()->set_momentum_buffer(momentum_buffer);
    auto created = client_->CreateHead(spec);
    ASSERT_TRUE(created.ok()) << created.status();
    ASSERT_TRUE(FillWindow(*client_, head_, kV, kD, "fill", &sequence_, 2, 8).ok());
  }
  // Everything an apply may change.
  struct State {
    std::vector<float> weights;
    uint64_t version, tokens, step;
    bool operator==(const State&) const = default;
  };
  State Now() {
    auto w = Weights(*client_, head_);
    auto info = client_->GetHead(head_);
    EXPECT_TRUE(w.ok() && info.ok());
    return {*w, info->weights_version(), info->tokens_since_pull(), info->optimizer_step()};
  }
  void TearDown() override {
    if (!head_.empty()) client_->DeleteHead(head_).IgnoreError();
  }

  std::string head_;
  uint64_t sequence_ = 0;
};

TEST_F(OptimizerSemanticsTest, RetriedApplyNeverStepsTwice) {
  Make("once", v1::OPTIMIZER_ADAMW);
  const v1::ApplyOptimizerRequest first = ApplyRequest(head_, "t", 5, AdamWParams(0.1, 0.01));
  auto applied = client_->ApplyOptimizer(first);
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_FALSE(applied->replayed());
  const State after = Now();
  // More micro-batches land in the next window; the repeat must neither step nor take them.
  ASSERT_TRUE(FillWindow(*client_, head_, kV, kD, "fill", &sequence_, 1, 8).ok());
  const State filled = Now();
  for (int i = 0; i < 3; ++i) {
    auto again = client_->ApplyOptimizer(first);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->replayed());
    v1::ApplyOptimizerResponse same = *again;
    same.set_replayed(false);
    EXPECT_EQ(same.SerializeAsString(), applied->SerializeAsString());
    EXPECT_TRUE(Now() == filled);
  }
  EXPECT_EQ(filled.weights, after.weights);
  EXPECT_EQ(filled.step, 1u);
  // Keys increase per client id: an older unremembered key is refused, a lower one too; another
  // client id has its own keys.
  EXPECT_EQ(
      client_->ApplyOptimizer(ApplyRequest(head_, "t", 4, AdamWParams(0.1, 0))).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Now() == filled);
  auto other = client_->ApplyOptimizer(ApplyRequest(head_, "u", 1, AdamWParams(0.1, 0)));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->optimizer_step(), 2u);
  // Beyond the remembered window (16 per client id) the first key is gone: refused, as it may
  // have stepped.
  for (uint64_t key = 6; key < 6 + 16; ++key) {
    v1::ApplyOptimizerRequest r = ApplyRequest(head_, "t", key, AdamWParams(0.0, 0));
    r.set_grad_divisor(1.0);
    ASSERT_TRUE(client_->ApplyOptimizer(r).ok()) << key;
  }
  const State late = Now();
  EXPECT_EQ(client_->ApplyOptimizer(first).status().code(), absl::StatusCode::kFailedPrecondition);
  // The retry must be the same request as the one remembered (a different one is refused).
  v1::ApplyOptimizerRequest retry = ApplyRequest(head_, "t", 21, AdamWParams(0.0, 0));
  retry.set_grad_divisor(1.0);
  auto remembered = client_->ApplyOptimizer(retry);
  ASSERT_TRUE(remembered.ok());
  EXPECT_TRUE(remembered->replayed());
  EXPECT_TRUE(Now() == late);
}

TEST_F(OptimizerSemanticsTest, EveryErrorHasItsCodeAndChangesNothing) {
  Make("errors", v1::OPTIMIZER_ADAMW);
  const State before = Now();
  using Edit = std::function<void(v1::ApplyOptimizerRequest&)>;
  const std::vector<std::pair<absl::StatusCode, Edit>> cases = {
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.mutable_params()->set_lr(kNaN); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.mutable_params()->set_lr(-1e-3); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.mutable_params()->set_beta1(1.0); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.mutable_params()->set_beta2(-0.1); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.mutable_params()->set_eps(0); }},
      {absl::StatusCode::kInvalidArgument,
       [](auto& r) { r.mutable_params()->set_weight_decay(-1); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_grad_divisor(0); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_grad_divisor(kNaN); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_grad_divisor(1e-300); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_max_norm(-1); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_trunk_grad_sq_norm(kNaN); }},
      {absl::StatusCode::kInvalidArgument, [](auto& r) { r.set_trunk_grad_sq_norm(-2); }},
      {absl::StatusCode::kFailedPrecondition, [](auto& r) { r.set_expected_weights_version(99); }},
      // Valid values whose step would carry W past fp32 (1 - lr * weight_decay overflows).
      {absl::StatusCode::kFailedPrecondition,
       [](auto& r) {
         r.mutable_params()->set_lr(1e38);
         r.mutable_params()->set_weight_decay(100);
       }},
      {absl::StatusCode::kNotFound, [](auto& r) { r.set_head("no-such-head"); }},
  };
  uint64_t key = 1;
  for (const auto& [code, edit] : cases) {
    v1::ApplyOptimizerRequest r = ApplyRequest(head_, "e", key++, AdamWParams(0.1, 0));
    edit(r);
    EXPECT_EQ(client_->ApplyOptimizer(r).status().code(), code) << r.ShortDebugString();
  }
  // The client refuses what it can tell is malformed before sending.
  EXPECT_EQ(
      client_->ApplyOptimizer(ApplyRequest(head_, "", 1, AdamWParams(0.1, 0))).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      client_->ApplyOptimizer(ApplyRequest(head_, "e", 0, AdamWParams(0.1, 0))).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Now() == before);
  // A double that fp32 rounds to 0 is refused as 0, with the value as sent beside it.
  v1::ApplyOptimizerRequest tiny = ApplyRequest(head_, "e", key++, AdamWParams(0.1, 0));
  tiny.mutable_params()->set_eps(1e-50);
  const absl::Status refused = client_->ApplyOptimizer(tiny).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "got 0")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "eps: 1e-50")) << refused;
  EXPECT_TRUE(Now() == before);
  // Failed keys are not remembered: the same key applies once the request is right.
  auto ok = client_->ApplyOptimizer(ApplyRequest(head_, "e", 1, AdamWParams(0.1, 0)));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->replayed());
  // Now the window is empty: without a divisor there is nothing to normalise by.
  const State empty = Now();
  EXPECT_EQ(
      client_->ApplyOptimizer(ApplyRequest(head_, "e", 2, AdamWParams(0.1, 0))).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Now() == empty);
}

TEST_F(OptimizerSemanticsTest, OptimizerKindsAndTheirPreconditions) {
  Make("kinds", v1::OPTIMIZER_NONE);
  const State before = Now();
  auto apply = [&](uint64_t key, const v1::OptimizerHyperParams& p) {
    return client_->ApplyOptimizer(ApplyRequest(head_, "k", key, p)).status().code();
  };
  EXPECT_EQ(apply(1, AdamWParams(0.1, 0)), absl::StatusCode::kFailedPrecondition);
  v1::OptimizerSpec bad;
  bad.set_kind(static_cast<v1::OptimizerKind>(42));
  EXPECT_EQ(client_->SetOptimizer(head_, bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.set_kind(v1::OPTIMIZER_ADAMW);
  bad.set_momentum_buffer(true);
  EXPECT_EQ(client_->SetOptimizer(head_, bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->SetOptimizer("no-such-head", bad).status().code(),
            absl::StatusCode::kNotFound);
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OPTIMIZER_SGD);
  ASSERT_TRUE(client_->SetOptimizer(head_, sgd).ok());
  // Momentum needs the buffer; nesterov needs momentum (torch's rule). A momentum no buffer
  // would make valid is INVALID_ARGUMENT, as it is on a head with the buffer.
  EXPECT_EQ(apply(1, SgdParams(0.1, 0.9, 0, false, 0)), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(apply(1, SgdParams(0.1, 0, 0, true, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(apply(1, SgdParams(0.1, kNaN, 0, false, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(apply(1, SgdParams(0.1, -0.5, 0, false, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Now() == before);
  v1::HeadSpec create;
  create.set_name("bad-kind");
  create.set_vocab_size(kV);
  create.set_hidden_size(kD);
  create.set_weight_dtype(v1::DTYPE_FP32);
  create.mutable_optimizer()->set_kind(static_cast<v1::OptimizerKind>(7));
  EXPECT_EQ(client_->CreateHead(create).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetHead("bad-kind").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(OptimizerSemanticsTest, MemoryIsInHeadInfo) {
  v1::HeadSpec spec;
  spec.set_name("memory");
  spec.set_vocab_size(33);
  spec.set_hidden_size(7);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  auto created = client_->CreateHead(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  head_ = "memory";
  const uint64_t buffer = 33 * 7 * 4;
  EXPECT_EQ(created->memory().weights_bytes(), 33u * 7 * 2);
  EXPECT_EQ(created->memory().master_weights_bytes(), buffer);
  EXPECT_EQ(created->memory().optimizer_state_bytes(), 2 * buffer);
  EXPECT_EQ(created->spec().optimizer().kind(), v1::OPTIMIZER_ADAMW);
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OPTIMIZER_SGD);
  sgd.set_momentum_buffer(true);
  auto set = client_->SetOptimizer(head_, sgd);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->memory().master_weights_bytes(), buffer);
  EXPECT_EQ(set->memory().optimizer_state_bytes(), buffer);
  EXPECT_TRUE(set->spec().optimizer().momentum_buffer());
  set = client_->SetOptimizer(head_, v1::OptimizerSpec());
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->memory().master_weights_bytes(), 0u);
  EXPECT_EQ(set->memory().optimizer_state_bytes(), 0u);
  EXPECT_EQ(set->spec().optimizer().kind(), v1::OPTIMIZER_NONE);
}

}  // namespace
}  // namespace losshead::testing
