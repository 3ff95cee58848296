// A micro-batch's run is in flight once launched: the next micro-batch launches behind it without
// waiting for its work, and a cut (a pull with reset, a checkpoint snapshot, an optimizer apply)
// waits until every run in flight is done and counted, so that it sees each micro-batch wholly in
// its window. The backend is the CPU one behind a wrapper whose stream marks stay unreached until
// released: a device still at work on a launched run.
#include <atomic>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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

constexpr int64_t kV = 19, kD = 8, kN = 5;

struct Layout {
  int devices = 1;     // with two or more, the head sharded over them
  bool stash = false;  // dW deferred into a stash (kernels/grad_stash.h), flushed at the cut
};

void PrintTo(const Layout& layout, std::ostream* os) {
  *os << layout.devices << " device(s)" << (layout.stash ? ", stashed" : "");
}

class RunInFlightTest : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    std::vector<kernels::Backend*> devices;
    for (int i = 0; i < GetParam().devices; ++i) {
      auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      backends_.push_back(std::make_unique<FaultyBackend>(std::move(*cpu)));
      devices.push_back(backends_.back().get());
    }
    v1::HeadSpec spec = Fp32HeadSpec(kV, kD, 5);
    if (GetParam().devices > 1) {
      spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
      spec.mutable_placement()->set_devices(GetParam().devices);
    }
    const HeadOptions options{.grad_stash_bytes = GetParam().stash ? size_t{1} << 20 : 0};
    auto head = Head::Create(devices, spec, options);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    auto w = head_->DownloadWeights(v1::DTYPE_FP32);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = FromBytes<float>(w->data);
  }

  static MicroBatch Batch(uint64_t seed, const std::string& client, uint64_t sequence) {
    return Fp32SumMicroBatch(kN, kD, kV, seed, client, sequence);
  }

  // The float64 reference's sum-reduced dW of `batches` together.
  std::vector<double> ReferenceGrad(const std::vector<MicroBatch>& batches) const {
    std::vector<double> sum(kV * kD, 0.0);
    for (const MicroBatch& mb : batches) {
      const auto y = FromBytes<int32_t>(mb.targets);
      const auto ref =
          testing::ReferenceMean(FromBytes<float>(mb.hidden), weights_, y, kN, kD, kV);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += ref.grad_weight[i] * ref.tokens;
    }
    return sum;
  }

  void HoldMarks() {
    for (auto& b : backends_) b->marks.Hold();
  }
  void ReleaseMarks() {
    for (auto& b : backends_) b->marks.Release();
  }
  // Whether `n` runs are held in flight on device 0 (each run marks every device it uses).
  bool InFlight(int n) { return backends_[0]->marks.AwaitWaiting(n); }

  // Steps `mb` on a thread of its own.
  std::thread StepAsync(const MicroBatch& mb, absl::Status* result) {
    return std::thread([this, mb, result] {
      StepStats stats;
      *result = head_->Step(mb, &stats).status();
    });
  }

  std::vector<std::unique_ptr<FaultyBackend>> backends_;
  std::shared_ptr<Head> head_;
  std::vector<float> weights_;
};

TEST_P(RunInFlightTest, TheNextMicroBatchLaunchesWhileOneIsInFlight) {
  HoldMarks();
  const std::vector<MicroBatch> batches = {Batch(1, "a", 1), Batch(2, "b", 1)};
  absl::Status first, second;
  std::thread a = StepAsync(batches[0], &first);
  ASSERT_TRUE(InFlight(1));
  // The first run's work is not done, yet the second takes the devices and launches behind it.
  std::thread b = StepAsync(batches[1], &second);
  const bool both = InFlight(2);
  ReleaseMarks();
  a.join();
  b.join();
  ASSERT_TRUE(both) << "the second micro-batch did not launch while the first was in flight";
  ASSERT_TRUE(first.ok()) << first;
  ASSERT_TRUE(second.ok()) << second;
  auto g = head_->PullGradient(v1::DTYPE_FP32, true);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->summary.microbatch_count(), 2u);
  EXPECT_EQ(g->summary.token_count(), static_cast<uint64_t>(2 * kN));
  const auto dw = FromBytes<float>(g->data);
  const std::vector<double> ref = ReferenceGrad(batches);
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], ref[i], 1e-4) << i;
}

TEST_P(RunInFlightTest, APullWithResetWaitsForTheRunInFlightAndCountsIt) {
  HoldMarks();
  const MicroBatch mb = Batch(3, "a", 1);
  absl::Status stepped;
  std::thread a = StepAsync(mb, &stepped);
  ASSERT_TRUE(InFlight(1));
  // The run has added to dW but is not counted yet: a cut now must wait for it.
  std::atomic<bool> pulled{false};
  absl::StatusOr<GradientSnapshot> g = absl::UnknownError("not pulled");
  std::thread pull([&] {
    g = head_->PullGradient(v1::DTYPE_FP32, true);
    pulled = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  const bool early = pulled.load();
  ReleaseMarks();
  a.join();
  pull.join();
  EXPECT_FALSE(early) << "the pull went through while a run was in flight";
  ASSERT_TRUE(stepped.ok()) << stepped;
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->summary.microbatch_count(), 1u);
  EXPECT_EQ(g->summary.token_count(), static_cast<uint64_t>(kN));
  const auto dw = FromBytes<float>(g->data);
  const std::vector<double> ref = ReferenceGrad({mb});
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], ref[i], 1e-4) << i;
  // The reset took it: the next window is empty.
  auto next = head_->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->summary.microbatch_count(), 0u);
  for (float x : FromBytes<float>(next->data)) ASSERT_EQ(x, 0.0f);
}

TEST_P(RunInFlightTest, ASnapshotWaitsForTheRunInFlightAndRemembersIt) {
  HoldMarks();
  const MicroBatch mb = Batch(4, "a", 9);
  absl::Status stepped;
  std::thread a = StepAsync(mb, &stepped);
  ASSERT_TRUE(InFlight(1));
  absl::StatusOr<HeadCheckpointData> snap = absl::UnknownError("not taken");
  std::thread take([&] { snap = head_->Snapshot(); });
  absl::SleepFor(absl::Milliseconds(100));
  ReleaseMarks();
  a.join();
  take.join();
  ASSERT_TRUE(stepped.ok()) << stepped;
  ASSERT_TRUE(snap.ok()) << snap.status();
  // Counted in the snapshot's window, its dW and among its remembered clients alike.
  EXPECT_EQ(snap->microbatches_since_pull, 1u);
  EXPECT_EQ(snap->tokens_since_pull, static_cast<uint64_t>(kN));
  ASSERT_EQ(snap->clients.size(), 1u);
  EXPECT_EQ(snap->clients[0].client_id, "a");
  const std::vector<float> dw = FromBytes<float>(snap->gradient);
  const std::vector<double> ref = ReferenceGrad({mb});
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], ref[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, RunInFlightTest,
                         ::testing::Values(Layout{1, false}, Layout{1, true}, Layout{2, false},
                                           Layout{3, true}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return (info.param.devices == 1
                                       ? std::string("OneDevice")
                                       : "ShardedOver" + std::to_string(info.param.devices)) +
                                  (info.param.stash ? "Stashed" : "");
                         });

}  // namespace
}  // namespace losshead::server
