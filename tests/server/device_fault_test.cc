// A device that fails in the middle of a micro-batch never gets it counted twice: once its run has
// begun, the micro-batch's key keeps the failure (DATA_LOSS) as its answer, also across a
// checkpoint, and no retry computes it again; a failure before the run touched nothing and a
// retry computes it afresh. The backend is the CPU one behind a wrapper that fails on demand.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/durability/checkpoint.h"
#include "server/engine/head.h"
#include "tests/server/faulty_backend.h"
#include "tests/server/fp32_microbatch.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::FaultyBackend;
using testing::FromBytes;

constexpr int64_t kV = 17, kD = 8, kN = 6;

class DeviceFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<FaultyBackend>(std::move(*cpu));
    auto head = Head::Create(*backend_, Spec(), HeadOptions{});
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    auto w = head_->DownloadWeights(v1::DTYPE_FP32);
    ASSERT_TRUE(w.ok());
    weights_ = FromBytes<float>(w->data);
  }

 public:
  // An fp32 head of kV x kD, the same W whatever its options.
  static v1::HeadSpec Spec() { return Fp32HeadSpec(kV, kD, 11); }
  // A sum-reduced fp32 micro-batch of kN tokens (also for the sharded test below).
  static MicroBatch Batch(uint64_t seed, const std::string& client, uint64_t sequence) {
    return Fp32SumMicroBatch(kN, kD, kV, seed, client, sequence);
  }

 protected:
  // dW must be exactly `count` times the float64 reference's sum-reduced gradient of `mb`.
  void ExpectGradientHolds(const MicroBatch& mb, int count) {
    const auto y = FromBytes<int32_t>(mb.targets);
    const auto ref = testing::ReferenceMean(FromBytes<float>(mb.hidden), weights_, y, kN, kD, kV);
    auto g = head_->PullGradient(v1::DTYPE_FP32, false);
    ASSERT_TRUE(g.ok()) << g.status();
    const auto dw = FromBytes<float>(g->data);
    ASSERT_EQ(dw.size(), ref.grad_weight.size());
    // The reference is mean-reduced over its tokens; the micro-batches are sum-reduced.
    for (size_t i = 0; i < dw.size(); ++i) {
      ASSERT_NEAR(dw[i], count * ref.grad_weight[i] * ref.tokens, 1e-4) << i;
    }
    EXPECT_EQ(g->summary.microbatch_count(), static_cast<uint64_t>(count));
    EXPECT_EQ(g->summary.token_count(), static_cast<uint64_t>(count * ref.tokens));
  }

  std::unique_ptr<FaultyBackend> backend_;
  std::shared_ptr<Head> head_;
  std::vector<float> weights_;
};

TEST_F(DeviceFaultTest, CopyOutFailureAfterTheCountIsRememberedAndNeverRecounted) {
  const MicroBatch mb = Batch(1, "c", 1);
  StepStats stats;
  backend_->fail_copy_out = true;
  auto failed = head_->Step(mb, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("was counted in dW"), absl::string_view::npos)
      << failed.status();
  EXPECT_NE(failed.status().message().find("injected"), absl::string_view::npos);
  ASSERT_EQ(backend_->runs.load(), 1);
  ExpectGradientHolds(mb, 1);
  EXPECT_EQ(head_->Progress("c").acknowledged_sequence(), 1u);

  // The device is healthy again: retries get the same answer, nothing is computed or counted.
  for (int i = 0; i < 3; ++i) {
    StepStats s;
    auto retry = head_->Step(mb, &s);
    EXPECT_EQ(retry.status(), failed.status());
    EXPECT_FALSE(s.replayed);
  }
  EXPECT_EQ(backend_->runs.load(), 1);
  ExpectGradientHolds(mb, 1);
  EXPECT_EQ(head_->Info().microbatches_total(), 1u);

  // Other keys go on as usual.
  const MicroBatch next = Batch(2, "c", 2);
  ASSERT_TRUE(head_->Step(next, &stats).ok());
  EXPECT_EQ(head_->Info().microbatches_total(), 2u);
}

TEST_F(DeviceFaultTest, RememberedFailureSurvivesACheckpointAndARestore) {
  const MicroBatch mb = Batch(3, "c", 7);
  StepStats stats;
  backend_->fail_copy_out = true;
  auto failed = head_->Step(mb, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  auto snap = head_->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  auto decoded = DecodeCheckpoint(EncodeCheckpoint(*snap));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  auto restored = Head::Restore(*backend_, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();
  head_ = *restored;
  const int runs = backend_->runs.load();
  auto retry = head_->Step(mb, &stats);
  EXPECT_EQ(retry.status(), failed.status());
  EXPECT_EQ(backend_->runs.load(), runs);
  ExpectGradientHolds(mb, 1);
  EXPECT_EQ(head_->Progress("c").persisted_sequence(), 7u);
  // A different micro-batch under the spent key is still told apart from a retry.
  EXPECT_EQ(head_->Step(Batch(4, "c", 7), &stats).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(DeviceFaultTest, RunFailureKeepsTheKeySpentAndIsNeverComputedAgain) {
  const MicroBatch mb = Batch(5, "c", 1);
  StepStats stats;
  backend_->fail_run = true;  // after the run has added to dW
  auto failed = head_->Step(mb, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("dW may hold"), absl::string_view::npos);
  const auto dw_after_fault = head_->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(dw_after_fault.ok());
  // The window's counters cannot vouch for what the failed run left; they do not count it.
  EXPECT_EQ(dw_after_fault->summary.microbatch_count(), 0u);
  auto retry = head_->Step(mb, &stats);
  EXPECT_EQ(retry.status(), failed.status());
  EXPECT_EQ(backend_->runs.load(), 1);
  const auto dw_after_retry = head_->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(dw_after_retry.ok());
  EXPECT_EQ(dw_after_retry->data, dw_after_fault->data);  // nothing added a second time
}

TEST_F(DeviceFaultTest, FailureBeforeTheRunIsForgottenAndTheRetryCountsOnce) {
  const MicroBatch mb = Batch(6, "c", 1);
  StepStats stats;
  backend_->fail_copy_in = true;
  auto failed = head_->Step(mb, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ(backend_->runs.load(), 0);
  EXPECT_EQ(head_->Info().microbatches_total(), 0u);
  EXPECT_FALSE(head_->Progress("c").has_acknowledged_sequence());
  auto retry = head_->Step(mb, &stats);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(stats.replayed);
  ExpectGradientHolds(mb, 1);
  auto replay = head_->Step(mb, &stats);
  ASSERT_TRUE(replay.ok());
  EXPECT_TRUE(stats.replayed);
  ExpectGradientHolds(mb, 1);
}

TEST_F(DeviceFaultTest, WithoutAClientIdTheFailureSaysItWasCounted) {
  const MicroBatch mb = Batch(8, "", 0);
  StepStats stats;
  backend_->fail_copy_out = true;
  auto failed = head_->Step(mb, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(failed.status().message().find("sending it again counts it again"),
            absl::string_view::npos)
      << failed.status();
  ExpectGradientHolds(mb, 1);
}

TEST_F(DeviceFaultTest, ForwardOnlyFailureCountsNothingAndIsNotRemembered) {
  MicroBatch mb = Batch(9, "c", 1);
  mb.header.mutable_options()->set_forward_only(true);
  StepStats stats;
  backend_->fail_copy_out = true;
  auto failed = head_->Step(mb, &stats);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  ExpectGradientHolds(mb, 0);
  EXPECT_TRUE(head_->Step(mb, &stats).ok());
  // The counted micro-batch with the same key is unaffected by the evaluation's failure.
  mb.header.mutable_options()->set_forward_only(false);
  EXPECT_TRUE(head_->Step(mb, &stats).ok());
  EXPECT_FALSE(stats.replayed);
  ExpectGradientHolds(mb, 1);
}

// With deferred dW: a head whose stash holds one micro-batch (kN tokens), flushed only when full
// or at a cut.
class DeferredFaultTest : public DeviceFaultTest {
 protected:
  void SetUp() override {
    DeviceFaultTest::SetUp();
    const kernels::Problem shape{.n = kN, .d = kD, .v = kV, .dtype = kernels::DType::kFP32};
    auto bytes = backend_->GradStashBytes(shape, kN);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto head = Head::Create(*backend_, Spec(), HeadOptions{.grad_stash_bytes = *bytes});
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;  // the same W as the fixture's head (same init)
  }
};

TEST_F(DeferredFaultTest, AFailedFlushIsAnsweredByTheNextCutAndDroppedWithTheWindow) {
  const MicroBatch first = Batch(11, "c", 1);
  const MicroBatch second = Batch(12, "c", 2);
  StepStats stats;
  ASSERT_TRUE(head_->Step(first, &stats).ok());
  EXPECT_EQ(backend_->flushes.load(), 0);  // stashed, not yet in dW
  // The second does not fit beside the first: the first is flushed, and the device fails.
  backend_->fail_flush = true;
  auto failed = head_->Step(second, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("dW lacks them"), absl::string_view::npos)
      << failed.status();
  // The second never ran: its retry computes it, once.
  auto retry = head_->Step(second, &stats);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(stats.replayed);
  EXPECT_EQ(backend_->runs.load(), 2);
  // The next cut that reads dW answers the lost micro-batch, and changes nothing.
  auto pull = head_->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_EQ(pull.status().code(), absl::StatusCode::kDataLoss) << pull.status();
  // The one after holds both micro-batches' counts and only the second's dW; its reset drops the
  // window.
  auto dropped = head_->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->summary.microbatch_count(), 2u);
  const auto y = FromBytes<int32_t>(second.targets);
  const auto ref = testing::ReferenceMean(FromBytes<float>(second.hidden), weights_, y, kN, kD, kV);
  const auto dw = FromBytes<float>(dropped->data);
  for (size_t i = 0; i < dw.size(); ++i) {
    ASSERT_NEAR(dw[i], ref.grad_weight[i] * ref.tokens, 1e-4) << i;
  }
  const MicroBatch third = Batch(13, "c", 3);
  ASSERT_TRUE(head_->Step(third, &stats).ok());
  ExpectGradientHolds(third, 1);
}

// The fixture's head sharded over two such devices.
class ShardedDeviceFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int r = 0; r < 2; ++r) {
      owned.push_back(
          std::make_unique<FaultyBackend>(*kernels::CreateBackend(kernels::BackendKind::kCpu)));
      devices.push_back(owned.back().get());
    }
    spec = DeviceFaultTest::Spec();
    spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
    spec.mutable_placement()->set_devices(2);
  }

  std::vector<std::unique_ptr<FaultyBackend>> owned;
  std::vector<kernels::Backend*> devices;
  v1::HeadSpec spec;
};

// A shard failing after it has added to its rows of dW spends the key (DATA_LOSS, never computed
// again), as on one device; a failure before any shard ran is forgotten and the retry counts once.
TEST_F(ShardedDeviceFaultTest, RunFailureSpendsTheKeyAndCopyInFailureIsForgotten) {
  auto head = Head::Create(devices, spec, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  StepStats stats;

  const MicroBatch first = DeviceFaultTest::Batch(3, "c", 1);
  owned[1]->fail_run = true;
  auto failed = (*head)->Step(first, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_EQ((*head)->Info().microbatches_total(), 0u);
  auto retry = (*head)->Step(first, &stats);
  EXPECT_EQ(retry.status(), failed.status());
  EXPECT_EQ(owned[0]->runs.load(), 1);  // never run again

  const MicroBatch second = DeviceFaultTest::Batch(4, "c", 2);
  owned[1]->fail_copy_in = true;
  failed = (*head)->Step(second, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ(owned[0]->runs.load(), 1);
  auto ok = (*head)->Step(second, &stats);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(stats.replayed);
  EXPECT_EQ((*head)->Info().microbatches_total(), 1u);
  auto replay = (*head)->Step(second, &stats);
  ASSERT_TRUE(replay.ok());
  EXPECT_TRUE(stats.replayed);
  EXPECT_EQ((*head)->Info().microbatches_total(), 1u);
}

// With deferred dW, each shard's stash holding one micro-batch: a flush that fails on one shard
// loses that shard's columns only. The micro-batch that needed the flush is not run (its retry
// counts once), the next cut answers DATA_LOSS, and the one after holds both micro-batches' counts,
// the first one's dW on the shard whose flush went through and not on the other.
TEST_F(ShardedDeviceFaultTest, AFailedFlushOnOneShardIsAnsweredByTheNextCut) {
  // Sized for the wider shard's columns: each shard's stash holds one micro-batch, not two.
  const kernels::Shard s0 = kernels::ShardRange(kV, 2, 0), s1 = kernels::ShardRange(kV, 2, 1);
  const kernels::Shard wide = s0.size() >= s1.size() ? s0 : s1;
  const kernels::ShardProblem shape{
      .problem = {.n = kN, .d = kD, .v = kV, .dtype = kernels::DType::kFP32},
      .row_begin = wide.begin,
      .rows = wide.size(),
      .shards = 2};
  auto bytes = owned[0]->GradStashBytes(kernels::ShardStashShape(shape), kN);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto head = Head::Create(devices, spec, HeadOptions{.grad_stash_bytes = *bytes});
  ASSERT_TRUE(head.ok()) << head.status();
  auto w = (*head)->DownloadWeights(v1::DTYPE_FP32);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<float> weights = FromBytes<float>(w->data);
  StepStats stats;

  const MicroBatch first = DeviceFaultTest::Batch(11, "c", 1);
  const MicroBatch second = DeviceFaultTest::Batch(12, "c", 2);
  ASSERT_TRUE((*head)->Step(first, &stats).ok());
  EXPECT_EQ(owned[0]->flushes.load() + owned[1]->flushes.load(), 0);  // stashed on both shards
  owned[1]->fail_flush = true;
  auto failed = (*head)->Step(second, &stats);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("dW lacks them"), absl::string_view::npos)
      << failed.status();
  EXPECT_EQ(owned[0]->flushes.load(), 1);
  EXPECT_EQ(owned[1]->flushes.load(), 1);
  auto retry = (*head)->Step(second, &stats);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(stats.replayed);
  EXPECT_EQ(owned[0]->runs.load(), 2);

  auto pull = (*head)->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_EQ(pull.status().code(), absl::StatusCode::kDataLoss) << pull.status();
  auto dropped = (*head)->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->summary.microbatch_count(), 2u);
  // Sum-reduced micro-batches: each one's dW is the mean reference's times its tokens.
  auto sum_dw = [&](const MicroBatch& mb) {
    const auto ref = testing::ReferenceMean(FromBytes<float>(mb.hidden), weights,
                                            FromBytes<int32_t>(mb.targets), kN, kD, kV);
    std::vector<double> dw(ref.grad_weight.size());
    for (size_t i = 0; i < dw.size(); ++i) dw[i] = ref.grad_weight[i] * ref.tokens;
    return dw;
  };
  const std::vector<double> dw_first = sum_dw(first), dw_second = sum_dw(second);
  const std::vector<float> dw = FromBytes<float>(dropped->data);
  ASSERT_EQ(dw.size(), dw_first.size());
  const kernels::Shard lost = kernels::ShardRange(kV, 2, 1);
  for (size_t i = 0; i < dw.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / kD;
    const bool kept = row < lost.begin || row >= lost.end;
    ASSERT_NEAR(dw[i], dw_second[i] + (kept ? dw_first[i] : 0.0), 1e-4) << "row " << row;
  }
}

}  // namespace
}  // namespace losshead::server
