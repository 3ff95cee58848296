// An optimizer step that would carry a weight past its dtype's range (fp16's 65504) or a master
// or state value past fp32's is refused before anything changes, on one device and on every
// placement; and the read-only check that finds it runs only where the bound of the head's
// magnitudes (kernels::StepMagnitudeBound) cannot rule an overflow out.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "tests/server/faulty_backend.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::FaultyBackend;
using testing::RandomFloats;

constexpr int64_t kV = 23, kD = 12, kN = 10;

enum class Placing { kOneDevice, kReplicated, kSharded };

struct RangeCase {
  v1::DType dtype;
  v1::OptimizerKind kind;
  Placing placing;
};

std::string CaseName(const RangeCase& c) {
  const char* placing = c.placing == Placing::kOneDevice    ? "OneDevice"
                        : c.placing == Placing::kReplicated ? "Replicated2"
                                                            : "Sharded2";
  return absl::StrCat(v1::DType_Name(c.dtype), "_", v1::OptimizerKind_Name(c.kind), "_", placing);
}

v1::HeadSpec Spec(const RangeCase& c, uint64_t seed) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(c.dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(seed);
  spec.mutable_optimizer()->set_kind(c.kind);
  spec.mutable_optimizer()->set_momentum_buffer(c.kind == v1::OPTIMIZER_SGD);
  if (c.placing != Placing::kOneDevice) {
    spec.mutable_placement()->set_kind(c.placing == Placing::kReplicated ? v1::PLACEMENT_REPLICATED
                                                                         : v1::PLACEMENT_SHARDED);
    spec.mutable_placement()->set_devices(2);
  }
  return spec;
}

MicroBatch Batch(uint64_t seed, uint64_t sequence) {
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id("c");
  mb.header.set_sequence(sequence);
  mb.header.set_num_tokens(kN);
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden = Bytes(RandomFloats(kN * kD, seed));
  std::vector<int32_t> y(kN);
  for (int64_t i = 0; i < kN; ++i) y[i] = static_cast<int32_t>((seed * 3 + 5 * i) % kV);
  mb.targets = Bytes(y);
  return mb;
}

// Hyper-parameters of `kind`: ordinary ones, or ones whose step overflows the dtype (fp16: a
// move of about lr; the others: a weight decay whose factor 1 - lr * wd is past fp32, or an SGD
// move of lr * wd * w).
v1::ApplyOptimizerRequest Apply(const RangeCase& c, uint64_t key, bool overflow) {
  v1::ApplyOptimizerRequest r;
  r.set_client_id("c");
  r.set_step_key(key);
  v1::OptimizerHyperParams& p = *r.mutable_params();
  p.set_lr(1e-3);
  p.set_beta1(0.9);
  p.set_beta2(c.kind == v1::OPTIMIZER_LION ? 0.99 : 0.999);
  p.set_eps(1e-8);
  p.set_momentum(c.kind == v1::OPTIMIZER_SGD ? 0.9 : 0.0);
  p.set_weight_decay(0.01);
  if (overflow) {
    const bool fp16 = c.dtype == v1::DTYPE_FP16;
    p.set_lr(fp16 ? 1e8 : 1e38);
    p.set_weight_decay(fp16 ? 0.0 : 100.0);
  }
  return r;
}

// The devices a case's head is placed on, each counting the checks run on it.
struct Devices {
  explicit Devices(int count) {
    for (int i = 0; i < count; ++i) {
      auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
      EXPECT_TRUE(cpu.ok());
      owned.push_back(std::make_unique<FaultyBackend>(std::move(*cpu)));
      devices.push_back(owned.back().get());
    }
  }
  int checks() const {
    int total = 0;
    for (const auto& d : owned) total += d->optimizer_checks.load();
    return total;
  }
  std::vector<std::unique_ptr<FaultyBackend>> owned;
  std::vector<kernels::Backend*> devices;
};

// One micro-batch (its sequence and seed the request's step key), then the apply.
void StepThenApply(Head& head, const v1::ApplyOptimizerRequest& request) {
  StepStats stats;
  const uint64_t key = request.step_key();
  ASSERT_TRUE(head.Step(Batch(key, key), &stats).ok());
  auto applied = head.ApplyOptimizer(request);
  ASSERT_TRUE(applied.ok()) << applied.status();
}

class OptimizerRangeTest : public ::testing::TestWithParam<RangeCase> {};

TEST_P(OptimizerRangeTest, AStepPastTheRangeIsRefusedAndChangesNothing) {
  const RangeCase& c = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  Devices devices(c.placing == Placing::kOneDevice ? 1 : 2);
  auto head = Head::Create(devices.devices, Spec(c, seed), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  StepStats stats;
  uint64_t sequence = 0;
  auto fill = [&] {
    for (int i = 0; i < 2; ++i) {
      ++sequence;
      ASSERT_TRUE((*head)->Step(Batch(seed + sequence, sequence), &stats).ok());
    }
  };
  // One ordinary step first, so that the state a refusal must keep is not all zeros.
  ASSERT_NO_FATAL_FAILURE(fill());
  ASSERT_TRUE((*head)->ApplyOptimizer(Apply(c, 1, false)).ok());
  ASSERT_NO_FATAL_FAILURE(fill());
  auto before = (*head)->Snapshot();
  ASSERT_TRUE(before.ok()) << before.status();

  auto refused = (*head)->ApplyOptimizer(Apply(c, 2, true));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "would overflow")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "nothing was stepped"));
  auto after = (*head)->Snapshot();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weights, before->weights);
  EXPECT_EQ(after->gradient, before->gradient);
  EXPECT_EQ(after->master, before->master);
  EXPECT_EQ(after->optimizer_state, before->optimizer_state);
  EXPECT_EQ(after->optimizer_step, before->optimizer_step);
  EXPECT_EQ(after->weights_version, before->weights_version);
  EXPECT_EQ(after->tokens_since_pull, before->tokens_since_pull);
  EXPECT_EQ(after->microbatches_since_pull, before->microbatches_since_pull);

  // The key was not spent: the same key with ordinary hyper-parameters steps the same window.
  auto applied = (*head)->ApplyOptimizer(Apply(c, 2, false));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->replayed());
  EXPECT_EQ(applied->window().token_count(), before->tokens_since_pull);
  EXPECT_EQ(applied->optimizer_step(), 2u);
}

std::vector<RangeCase> RangeCases() {
  std::vector<RangeCase> cases;
  for (v1::DType dtype : {v1::DTYPE_FP16, v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    for (v1::OptimizerKind kind : {v1::OPTIMIZER_ADAMW, v1::OPTIMIZER_SGD, v1::OPTIMIZER_LION}) {
      for (Placing placing : {Placing::kOneDevice, Placing::kReplicated, Placing::kSharded}) {
        cases.push_back({dtype, kind, placing});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Heads, OptimizerRangeTest, ::testing::ValuesIn(RangeCases()),
                         [](const auto& info) { return CaseName(info.param); });

// The check reads every buffer a step reads: an apply runs it only where the head's magnitudes
// are not known (after a new optimizer, a push, a restore) or their bound reaches the dtype's
// range. Over two replicas each checks its own rows.
TEST(OptimizerRangeCheckTest, RunsOnlyWhereTheBoundCannotRuleOutAnOverflow) {
  const RangeCase c{v1::DTYPE_BF16, v1::OPTIMIZER_ADAMW, Placing::kReplicated};
  Devices devices(2);
  auto head = Head::Create(devices.devices, Spec(c, 7), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  ASSERT_NO_FATAL_FAILURE(StepThenApply(**head, Apply(c, 1, false)));
  EXPECT_EQ(devices.checks(), 2) << "magnitudes unknown at first: each replica checks its rows";
  for (uint64_t key = 2; key <= 5; ++key) {
    ASSERT_NO_FATAL_FAILURE(StepThenApply(**head, Apply(c, key, false)));
  }
  EXPECT_EQ(devices.checks(), 2) << "bf16 weights of size 1 with lr 1e-3 are far from overflowing";

  // A push makes the master unknown again.
  const std::vector<float> pushed = RandomFloats(kV * kD, 3);
  ASSERT_TRUE((*head)
                  ->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), std::nullopt)
                  .ok());
  ASSERT_NO_FATAL_FAILURE(StepThenApply(**head, Apply(c, 6, false)));
  EXPECT_EQ(devices.checks(), 4);
  ASSERT_NO_FATAL_FAILURE(StepThenApply(**head, Apply(c, 7, false)));
  EXPECT_EQ(devices.checks(), 4);

  // An lr whose bound reaches bf16's range is checked (and, the moves being far smaller than
  // the bound, allowed): AdamW's bound divides the first moment by eps.
  v1::ApplyOptimizerRequest large = Apply(c, 8, false);
  large.mutable_params()->set_lr(1e34);
  large.mutable_params()->set_weight_decay(0.0);
  ASSERT_NO_FATAL_FAILURE(StepThenApply(**head, large));
  EXPECT_EQ(devices.checks(), 6);
}

// SGD without momentum leaves its momentum buffer unread: a check then learns nothing of it, so
// after a push (the magnitudes forgotten) the next apply with momentum is checked again.
TEST(OptimizerRangeCheckTest, AMomentumBufferNoCheckReadIsCheckedBeforeItIsUsed) {
  const RangeCase c{v1::DTYPE_FP32, v1::OPTIMIZER_SGD, Placing::kOneDevice};
  Devices devices(1);
  auto head = Head::Create(devices.devices, Spec(c, 5), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  auto step_and_apply = [&](uint64_t key, double momentum) {
    v1::ApplyOptimizerRequest r = Apply(c, key, false);
    r.mutable_params()->set_momentum(momentum);
    StepThenApply(**head, r);
  };
  ASSERT_NO_FATAL_FAILURE(step_and_apply(1, 0.9));
  ASSERT_NO_FATAL_FAILURE(step_and_apply(2, 0.9));
  EXPECT_EQ(devices.checks(), 1);
  const std::vector<float> pushed = RandomFloats(kV * kD, 4);
  ASSERT_TRUE((*head)
                  ->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), std::nullopt)
                  .ok());
  ASSERT_NO_FATAL_FAILURE(step_and_apply(3, 0.0));
  EXPECT_EQ(devices.checks(), 2);
  ASSERT_NO_FATAL_FAILURE(step_and_apply(4, 0.9));
  EXPECT_EQ(devices.checks(), 3) << "the buffer's size was not known";
  ASSERT_NO_FATAL_FAILURE(step_and_apply(5, 0.9));
  EXPECT_EQ(devices.checks(), 3);
}

}  // namespace
}  // namespace losshead::server
