// dH delivered device to device (MicroBatch::grad_hidden_to, a same-node client's device region on
// a CUDA server): the run's dH lands there bit for bit as in the outcome, and matches the float64
// reference; where the copy does not apply (a replay, another dtype, too little room, no dH) the
// destination is untouched; a copy that fails leaves the outcome whole and counted once. The
// CPU backend's device memory is host memory, so a vector stands for the region.
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "tests/server/faulty_backend.h"
#include "tests/server/fp32_microbatch.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::FaultyBackend;
using testing::FromBytes;

constexpr int64_t kV = 19, kD = 8, kN = 7;
constexpr size_t kGradBytes = kN * kD * sizeof(float);

v1::HeadSpec Spec(uint32_t shards) {
  v1::HeadSpec spec = Fp32HeadSpec(kV, kD, 5);
  if (shards > 0) {
    spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
    spec.mutable_placement()->set_devices(shards);
  }
  return spec;
}

// Bytes no dH holds: every float a NaN.
std::vector<float> Poisoned(size_t floats) {
  return std::vector<float>(floats, std::numeric_limits<float>::quiet_NaN());
}

bool Untouched(const std::vector<float>& region) {
  for (float x : region) {
    if (x == x) return false;  // a number: something was written
  }
  return true;
}

class GradHiddenDeliveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<FaultyBackend>(std::move(*cpu));
    auto head = Head::Create(*backend_, Spec(0), HeadOptions{});
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    auto w = head_->DownloadWeights(v1::DTYPE_FP32);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = FromBytes<float>(w->data);
  }

  // A micro-batch whose dH goes into `region` as well (its room `bytes`).
  static MicroBatch Aimed(uint64_t seed, uint64_t sequence, std::vector<float>& region,
                          size_t bytes = kGradBytes) {
    MicroBatch mb = Fp32SumMicroBatch(kN, kD, kV, seed, "c", sequence);
    mb.grad_hidden_to = region.data();
    mb.grad_hidden_to_bytes = bytes;
    return mb;
  }

  std::unique_ptr<FaultyBackend> backend_;
  std::shared_ptr<Head> head_;
  std::vector<float> weights_;
};

TEST_F(GradHiddenDeliveryTest, DeliveredDHIsTheOutcomesAndTheReferences) {
  std::vector<float> region = Poisoned(kN * kD);
  const MicroBatch mb = Aimed(1, 1, region);
  StepStats stats;
  auto outcome = head_->Step(mb, &stats);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_TRUE(stats.grad_hidden_delivery.has_value());
  EXPECT_TRUE(stats.grad_hidden_delivery->ok()) << *stats.grad_hidden_delivery;
  const std::string& grad = (*outcome)->grad_hidden;
  ASSERT_EQ(grad.size(), kGradBytes);
  EXPECT_EQ(std::memcmp(region.data(), grad.data(), kGradBytes), 0);
  // Sum-reduced here; the reference is mean-reduced over its counted tokens.
  const auto ref = testing::ReferenceMean(FromBytes<float>(mb.hidden), weights_,
                                          FromBytes<int32_t>(mb.targets), kN, kD, kV);
  for (int64_t i = 0; i < kN * kD; ++i) {
    ASSERT_NEAR(region[i], ref.grad_hidden[i] * ref.tokens, 1e-4) << i;
  }

  // A replay answers from what was remembered: the caller writes dH its own way.
  std::vector<float> again = Poisoned(kN * kD);
  StepStats replay;
  auto replayed = head_->Step(Aimed(1, 1, again), &replay);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replay.replayed);
  EXPECT_FALSE(replay.grad_hidden_delivery.has_value());
  EXPECT_TRUE(Untouched(again));
  EXPECT_EQ((*replayed)->grad_hidden, grad);
  EXPECT_EQ(head_->Info().microbatches_total(), 1u);
}

TEST_F(GradHiddenDeliveryTest, NotTriedWhereItDoesNotApply) {
  std::vector<float> region = Poisoned(kN * kD);
  uint64_t sequence = 0;
  const auto expect_not_tried = [&](const MicroBatch& mb, const std::string& what) {
    StepStats stats;
    auto outcome = head_->Step(mb, &stats);
    ASSERT_TRUE(outcome.ok()) << what << ": " << outcome.status();
    EXPECT_FALSE(stats.grad_hidden_delivery.has_value()) << what;
    EXPECT_TRUE(Untouched(region)) << what;
  };
  expect_not_tried(Aimed(2, ++sequence, region, kGradBytes - 1), "one byte too little room");
  MicroBatch bf16 = Aimed(3, ++sequence, region);
  bf16.header.mutable_options()->set_grad_hidden_dtype(v1::DTYPE_BF16);
  expect_not_tried(bf16, "dH asked in bf16 of an fp32 head (converted on the host)");
  MicroBatch none = Aimed(4, ++sequence, region);
  none.header.mutable_options()->set_skip_grad_hidden(true);
  expect_not_tried(none, "no dH asked");
  EXPECT_EQ(head_->Info().microbatches_total(), 3u);
}

TEST_F(GradHiddenDeliveryTest, AFailedCopyLeavesTheOutcomeWholeAndCountedOnce) {
  std::vector<float> region = Poisoned(kN * kD);
  const MicroBatch mb = Aimed(5, 1, region);
  backend_->fail_copy_on_device = true;
  StepStats stats;
  auto outcome = head_->Step(mb, &stats);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_TRUE(stats.grad_hidden_delivery.has_value());
  EXPECT_EQ(stats.grad_hidden_delivery->code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Untouched(region));
  ASSERT_EQ((*outcome)->grad_hidden.size(), kGradBytes);
  EXPECT_EQ(head_->Info().microbatches_total(), 1u);
  EXPECT_EQ(backend_->runs.load(), 1);

  // The next one goes there again.
  std::vector<float> next = Poisoned(kN * kD);
  StepStats s;
  auto second = head_->Step(Aimed(6, 2, next), &s);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(s.grad_hidden_delivery.has_value());
  EXPECT_TRUE(s.grad_hidden_delivery->ok());
  EXPECT_EQ(std::memcmp(next.data(), (*second)->grad_hidden.data(), kGradBytes), 0);
}

TEST(GradHiddenDeliveryShardedTest, AShardedHeadsDHComesFromItsFirstShard) {
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  for (int i = 0; i < 2; ++i) {
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backends.push_back(*std::move(cpu));
  }
  kernels::Backend* const two[] = {backends[0].get(), backends[1].get()};
  auto head = Head::Create(two, Spec(2), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> region = Poisoned(kN * kD);
  MicroBatch mb = Fp32SumMicroBatch(kN, kD, kV, 7, "c", 1);
  mb.grad_hidden_to = region.data();
  mb.grad_hidden_to_bytes = kGradBytes;
  StepStats stats;
  auto outcome = (*head)->Step(mb, &stats);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_TRUE(stats.grad_hidden_delivery.has_value());
  EXPECT_TRUE(stats.grad_hidden_delivery->ok()) << *stats.grad_hidden_delivery;
  ASSERT_EQ((*outcome)->grad_hidden.size(), kGradBytes);
  EXPECT_EQ(std::memcmp(region.data(), (*outcome)->grad_hidden.data(), kGradBytes), 0);
  EXPECT_FALSE(Untouched(region));
}

}  // namespace
}  // namespace losshead::server
