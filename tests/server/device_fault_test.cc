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
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::FromBytes;
using testing::RandomFloats;

constexpr int64_t kV = 17, kD = 8, kN = 6;

// The CPU backend, with faults to order: the next copy of results to the host (anything larger
// than the 16 bytes of scalars read under the compute lock), the next run (after it has added to
// dW, as a device that fails midway would), or the next copy to the device.
class FaultyBackend : public kernels::Backend {
 public:
  explicit FaultyBackend(std::unique_ptr<kernels::Backend> inner) : inner_(std::move(inner)) {}

  std::atomic<bool> fail_copy_out{false};
  std::atomic<bool> fail_run{false};
  std::atomic<bool> fail_copy_in{false};
  std::atomic<int> runs{0};

  absl::string_view name() const override { return inner_->name(); }
  std::string device_description() const override { return inner_->device_description(); }
  kernels::MemoryInfo memory_info() const override { return inner_->memory_info(); }
  absl::Status CanImplement(const kernels::Problem& p) const override {
    return inner_->CanImplement(p);
  }
  absl::StatusOr<size_t> WorkspaceBytes(const kernels::Problem& p, size_t budget) const override {
    return inner_->WorkspaceBytes(p, budget);
  }
  absl::Status Run(const kernels::Problem& p, const kernels::Arguments& args,
                   kernels::Stream& stream) override {
    ++runs;
    absl::Status status = inner_->Run(p, args, stream);
    if (status.ok() && fail_run.exchange(false)) {
      return absl::InternalError("injected: the device failed during the run");
    }
    return status;
  }
  // A shard's halves: `fail_run` strikes after its backward half has added to dW.
  absl::StatusOr<kernels::ShardPlan> PlanShard(const kernels::ShardProblem& shard,
                                               size_t budget) const override {
    return inner_->PlanShard(shard, budget);
  }
  absl::Status ShardBegin(const kernels::ShardProblem& shard, const kernels::ShardArguments& args,
                          kernels::Stream& stream) override {
    ++runs;
    return inner_->ShardBegin(shard, args, stream);
  }
  absl::Status ShardForward(const kernels::ShardProblem& shard, const kernels::ShardArguments& args,
                            kernels::ShardChunk chunk, kernels::Stream& stream) override {
    return inner_->ShardForward(shard, args, chunk, stream);
  }
  absl::Status ShardBackward(const kernels::ShardProblem& shard,
                             const kernels::ShardArguments& args, kernels::ShardChunk chunk,
                             kernels::Stream& stream) override {
    absl::Status status = inner_->ShardBackward(shard, args, chunk, stream);
    if (status.ok() && fail_run.exchange(false)) {
      return absl::InternalError("injected: the device failed during the run");
    }
    return status;
  }
  absl::Status ShardStoreGradHidden(const kernels::ShardProblem& shard, const float* partial,
                                    kernels::ShardChunk chunk, void* grad_hidden,
                                    kernels::Stream& stream) override {
    return inner_->ShardStoreGradHidden(shard, partial, chunk, grad_hidden, stream);
  }
  absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                           kernels::Stream& stream) override {
    return inner_->SquaredNorm(data, count, result, stream);
  }
  absl::Status OptimizerStep(const kernels::OptimizerProblem& problem,
                             const kernels::OptimizerTensors& tensors,
                             kernels::Stream& stream) override {
    return inner_->OptimizerStep(problem, tensors, stream);
  }
  absl::StatusOr<kernels::DeviceBuffer> Allocate(size_t bytes) override {
    return inner_->Allocate(bytes);  // owned (and freed) by the inner backend
  }
  absl::StatusOr<std::unique_ptr<kernels::Stream>> CreateStream() override {
    return inner_->CreateStream();
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes,
                            kernels::Stream& stream) override {
    if (fail_copy_in.exchange(false)) {
      return absl::InternalError("injected: the copy to the device failed");
    }
    return inner_->CopyToDevice(dst, src, bytes, stream);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes,
                          kernels::Stream& stream) override {
    if (bytes > 16 && fail_copy_out.exchange(false)) {
      return absl::InternalError("injected: the copy of results to the host failed");
    }
    return inner_->CopyToHost(dst, src, bytes, stream);
  }
  absl::Status Memset(void* dst, int value, size_t bytes, kernels::Stream& stream) override {
    return inner_->Memset(dst, value, bytes, stream);
  }
  absl::StatusOr<kernels::HostBuffer> AllocateHost(size_t bytes) override {
    return inner_->AllocateHost(bytes);
  }

 protected:
  void Free(void*) override {}  // every buffer belongs to the inner backend

 private:
  std::unique_ptr<kernels::Backend> inner_;
};

class DeviceFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<FaultyBackend>(std::move(*cpu));
    v1::HeadSpec spec;
    spec.set_name("h");
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(v1::DTYPE_FP32);
    spec.mutable_init()->mutable_normal()->set_std(0.5f);
    spec.mutable_init()->mutable_normal()->set_seed(11);
    auto head = Head::Create(*backend_, spec, HeadOptions{});
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    auto w = head_->DownloadWeights(v1::DTYPE_FP32);
    ASSERT_TRUE(w.ok());
    weights_ = FromBytes<float>(w->data);
  }

 public:
  // A sum-reduced fp32 micro-batch of kN tokens (also for the sharded test below).
  static MicroBatch Batch(uint64_t seed, const std::string& client, uint64_t sequence) {
    MicroBatch mb;
    mb.header.set_head("h");
    mb.header.set_client_id(client);
    mb.header.set_sequence(sequence);
    mb.header.set_num_tokens(kN);
    mb.header.set_hidden_dtype(v1::DTYPE_FP32);
    mb.header.set_target_dtype(v1::DTYPE_INT32);
    mb.header.mutable_loss_options()->set_reduction(v1::REDUCTION_SUM);
    mb.hidden = Bytes(RandomFloats(kN * kD, seed));
    std::vector<int32_t> y(kN);
    for (int64_t i = 0; i < kN; ++i) y[i] = static_cast<int32_t>((seed * 3 + 5 * i) % kV);
    mb.targets = Bytes(y);
    return mb;
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

// A head sharded over two such devices: a shard failing after it has added to its rows of dW
// spends the key (DATA_LOSS, never computed again), as on one device; a failure before any shard
// ran is forgotten and the retry counts once.
TEST(ShardedDeviceFaultTest, RunFailureSpendsTheKeyAndCopyInFailureIsForgotten) {
  std::vector<std::unique_ptr<FaultyBackend>> owned;
  std::vector<kernels::Backend*> devices;
  for (int r = 0; r < 2; ++r) {
    owned.push_back(
        std::make_unique<FaultyBackend>(*kernels::CreateBackend(kernels::BackendKind::kCpu)));
    devices.push_back(owned.back().get());
  }
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
  spec.mutable_placement()->set_devices(2);
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

}  // namespace
}  // namespace losshead::server
