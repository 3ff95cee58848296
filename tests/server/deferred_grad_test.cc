// Deferred dW in a head: counted micro-batches leave their part of dW in each device's stash and
// are answered at once; the stash reaches dW when full, at every cut that reads dW, and when the
// device is idle. Under concurrent streams and pulls with reset, on one device, replicated on two
// and vocabulary-sharded over two and three (a stash per shard), the pulled windows add up to the
// float64 dW of every micro-batch, each counted once; an optimizer apply and a checkpoint see the
// stashed micro-batches too; the devices' flushes are launched together. CPU backends stand in for
// the devices.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "tests/server/faulty_backend.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Decode;
using testing::ExpectClose;
using testing::FaultyBackend;
using testing::kD;
using testing::MakeSample;
using testing::Pulled;
using testing::ReferenceMean;
using testing::Sample;
using testing::Weights;

constexpr int64_t kV = 29;
constexpr int64_t kStashTokens = 20;  // two or three micro-batches of 4-12 tokens

struct Placement {
  int devices;
  v1::DType dtype;
  bool sharded = false;  // over `devices` vocabulary shards, else replicated on them
};

void PrintTo(const Placement& p, std::ostream* os) {
  *os << p.devices << " device(s)" << (p.sharded ? " sharded, " : ", ") << v1::DType_Name(p.dtype);
}

std::string Name(const ::testing::TestParamInfo<Placement>& info) {
  return absl::StrCat(info.param.devices, "dev_", info.param.sharded ? "sharded_" : "",
                      info.param.dtype == v1::DTYPE_BF16 ? "bf16" : "fp32");
}

v1::HeadSpec Spec(const Placement& p) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(p.dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(5);
  if (p.devices > 1) {
    spec.mutable_placement()->set_kind(p.sharded ? v1::PLACEMENT_SHARDED
                                                 : v1::PLACEMENT_REPLICATED);
    spec.mutable_placement()->set_devices(p.devices);
  }
  return spec;
}

class DeferredGradTest : public ::testing::TestWithParam<Placement> {
 protected:
  // A head on CPU devices (wrapped, so that flushes are counted) whose stash holds kStashTokens.
  void MakeHead(absl::Duration idle, v1::OptimizerKind optimizer = v1::OPTIMIZER_NONE) {
    const Placement& p = GetParam();
    std::vector<kernels::Backend*> list;
    for (int r = 0; r < p.devices; ++r) {
      auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      devices_.push_back(std::make_unique<FaultyBackend>(std::move(*cpu)));
      devices_.back()->call_log = &calls_;
      devices_.back()->tag = absl::StrCat(r);
      list.push_back(devices_.back().get());
    }
    // A shard's stash holds its columns of G: sized on shard 0's rows, it holds as many tokens.
    const int64_t columns = p.sharded ? kernels::ShardRange(kV, p.devices, 0).size() : kV;
    const kernels::Problem shape{
        .n = 1, .d = kD, .v = columns, .dtype = testing::KernelDType(p.dtype)};
    auto bytes = devices_[0]->GradStashBytes(shape, kStashTokens);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    v1::HeadSpec spec = Spec(p);
    spec.mutable_optimizer()->set_kind(optimizer);
    auto head =
        Head::Create(list, spec, HeadOptions{.grad_stash_bytes = *bytes, .grad_stash_idle = idle});
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    w_ = Decode(Weights(*head_), p.dtype);
  }

  int Flushes() const {
    int total = 0;
    for (const auto& d : devices_) total += d->flushes.load();
    return total;
  }

  // Every sample's fp64 dW (mean-reduced over its own tokens), summed.
  std::vector<double> ReferenceWindow(const std::vector<Sample>& samples) const {
    std::vector<double> window(kV * kD, 0.0);
    for (const Sample& s : samples) {
      const auto r = ReferenceMean(s.hidden, w_, s.targets, s.mb.header.num_tokens(), kD, kV);
      for (size_t i = 0; i < window.size(); ++i) window[i] += r.grad_weight[i];
    }
    return window;
  }

  testing::CallLog calls_;  // outlives the devices that log to it
  std::vector<std::unique_ptr<FaultyBackend>> devices_;
  std::shared_ptr<Head> head_;
  std::vector<float> w_;
};

TEST_P(DeferredGradTest, PulledWindowsAddUpToEveryMicroBatchUnderConcurrentStreams) {
  MakeHead(absl::InfiniteDuration());
  const v1::DType dtype = GetParam().dtype;
  constexpr int kClients = 3, kPerClient = 8;
  std::vector<Sample> samples;
  for (int c = 0; c < kClients; ++c) {
    for (int i = 0; i < kPerClient; ++i) {
      const uint64_t seed = 1000 * c + i + 1;
      samples.push_back(MakeSample(4 + static_cast<int64_t>(seed * 7 % 9), kV, dtype, seed,
                                   absl::StrCat("c", c), static_cast<uint64_t>(i + 1)));
    }
  }
  // Each client sends its micro-batches in order while a trainer pulls with reset.
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < kPerClient; ++i) {
        const Sample& s = samples[c * kPerClient + i];
        StepStats stats;
        auto outcome = head_->Step(s.mb, &stats);
        ASSERT_TRUE(outcome.ok()) << outcome.status();
        const auto r = ReferenceMean(s.hidden, w_, s.targets, s.mb.header.num_tokens(), kD, kV);
        EXPECT_NEAR((*outcome)->loss, r.loss_sum / r.tokens, 1e-3 * (1 + r.loss_sum / r.tokens));
      }
    });
  }
  std::vector<Pulled> pulls;
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    pulls.push_back(testing::Pull(*head_, /*reset=*/true));
  }
  for (std::thread& t : clients) t.join();
  pulls.push_back(testing::Pull(*head_, /*reset=*/true));

  std::vector<float> total(kV * kD, 0.0f);
  uint64_t tokens = 0, microbatches = 0;
  for (const Pulled& p : pulls) {
    ASSERT_EQ(p.values.size(), total.size());
    for (size_t i = 0; i < total.size(); ++i) total[i] += p.values[i];
    tokens += p.summary.token_count();
    microbatches += p.summary.microbatch_count();
  }
  uint64_t sent_tokens = 0;
  for (const Sample& s : samples) sent_tokens += s.tokens;
  EXPECT_EQ(microbatches, static_cast<uint64_t>(kClients * kPerClient));
  EXPECT_EQ(tokens, sent_tokens);
  // The stash filled and emptied along the way, not only at the pulls.
  EXPECT_GT(Flushes(), 5);
  const std::vector<double> want = ReferenceWindow(samples);
  double scale = 0;
  for (double x : want) scale = std::max(scale, std::abs(x));
  ExpectClose(total, want, 1e-4 * scale, "sum of the pulled windows");
}

TEST_P(DeferredGradTest, AnIdleDeviceAddsItsStashToDw) {
  MakeHead(absl::Milliseconds(1));
  std::vector<Sample> samples;
  for (uint64_t i = 1; i <= 2; ++i) {
    samples.push_back(MakeSample(6, kV, GetParam().dtype, 70 + i, "c", i));
    StepStats stats;
    ASSERT_TRUE(head_->Step(samples.back().mb, &stats).ok());
  }
  // Nothing reads dW and the stash is far from full: only the idle flush can add it. Sent one at
  // a time, the micro-batches went round the replicas: each device flushes its own. Every shard
  // holds a part of both.
  const Placement& p = GetParam();
  const int devices_used = p.sharded ? p.devices : std::min(p.devices, 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (Flushes() < devices_used && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(Flushes(), devices_used);
  const int flushed = Flushes();
  const Pulled pulled = testing::Pull(*head_, /*reset=*/false);
  EXPECT_EQ(Flushes(), flushed);  // the pull found nothing left to add
  EXPECT_EQ(pulled.summary.microbatch_count(), 2u);
  const std::vector<double> want = ReferenceWindow(samples);
  double scale = 0;
  for (double x : want) scale = std::max(scale, std::abs(x));
  ExpectClose(pulled.values, want, 1e-4 * scale, "dW after the idle flush");
}

TEST_P(DeferredGradTest, AnOptimizerStepAndACheckpointSeeTheStashedMicroBatches) {
  MakeHead(absl::InfiniteDuration(), v1::OPTIMIZER_SGD);
  const v1::DType dtype = GetParam().dtype;
  std::vector<Sample> samples;
  for (uint64_t i = 1; i <= 3; ++i) {
    samples.push_back(MakeSample(5, kV, dtype, 90 + i, "c", i));
    StepStats stats;
    ASSERT_TRUE(head_->Step(samples.back().mb, &stats).ok());
  }
  // The checkpoint's gradient is the window of all three, though some still sat in the stash.
  auto snap = head_->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  const std::vector<double> want = ReferenceWindow(samples);
  double scale = 0;
  for (double x : want) scale = std::max(scale, std::abs(x));
  ExpectClose(testing::FromBytes<float>(snap->gradient), want, 1e-4 * scale, "checkpointed dW");

  // One more, left in the stash; SGD (lr 1, divisor 1) then moves W by the whole window.
  samples.push_back(MakeSample(7, kV, dtype, 99, "c", 4));
  StepStats stats;
  ASSERT_TRUE(head_->Step(samples.back().mb, &stats).ok());
  v1::ApplyOptimizerRequest apply;
  apply.set_head("h");
  apply.set_client_id("trainer");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(1.0);
  apply.mutable_params()->set_weight_decay(0.0);
  apply.set_grad_divisor(1.0);
  auto applied = head_->ApplyOptimizer(apply);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->window().microbatch_count(), 4u);
  const std::vector<double> window = ReferenceWindow(samples);
  const std::vector<float> stepped = Decode(Weights(*head_), dtype);
  std::vector<double> expected(w_.size());
  for (size_t i = 0; i < w_.size(); ++i) expected[i] = w_[i] - window[i];
  // bf16 W rounds the result to 2^-8 of its size.
  ExpectClose(stepped, expected, dtype == v1::DTYPE_BF16 ? 1e-2 : 1e-4, "W after the step");
}

TEST_P(DeferredGradTest, ADiscardDropsTheStashedMicroBatchesWithTheWindow) {
  MakeHead(absl::InfiniteDuration());
  const v1::DType dtype = GetParam().dtype;
  // 4-12 tokens each, more than the stash holds: some reach dW when the stash fills, the last
  // ones still wait in it when the window is discarded.
  std::vector<Sample> dropped;
  uint64_t dropped_tokens = 0;
  for (uint64_t i = 1; i <= 5; ++i) {
    dropped.push_back(MakeSample(4 + static_cast<int64_t>(i * 5 % 9), kV, dtype, 300 + i, "c", i));
    dropped_tokens += dropped.back().tokens;
    StepStats stats;
    ASSERT_TRUE(head_->Step(dropped.back().mb, &stats).ok());
  }
  const int flushed = Flushes();
  EXPECT_GT(flushed, 0);
  auto discarded = head_->WindowSummary(v1::DTYPE_FP32, /*discard=*/true);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(discarded->microbatch_count(), 5u);
  EXPECT_EQ(discarded->token_count(), dropped_tokens);
  EXPECT_EQ(Flushes(), flushed);  // the stash was dropped, not added to dW

  // The next window holds these alone, in the stash and in dW: nothing of the dropped stash
  // reaches dW at the pull's flush.
  std::vector<Sample> kept;
  for (uint64_t i = 6; i <= 8; ++i) {
    kept.push_back(MakeSample(3 + static_cast<int64_t>(i % 4), kV, dtype, 300 + i, "c", i));
    StepStats stats;
    ASSERT_TRUE(head_->Step(kept.back().mb, &stats).ok());
  }
  const Pulled pulled = testing::Pull(*head_, /*reset=*/true);
  EXPECT_EQ(pulled.summary.microbatch_count(), 3u);
  const std::vector<double> want = ReferenceWindow(kept);
  double scale = 0;
  for (double x : want) scale = std::max(scale, std::abs(x));
  ExpectClose(pulled.values, want, 1e-4 * scale, "dW of the window after the discard");
}

// `calls` holds `flushes` flushes, one per device, with no wait for a stream between the first
// and the last: every device's flush was launched before any was waited for.
void ExpectFlushesTogether(const std::vector<std::string>& calls, int flushes,
                           const std::string& when) {
  std::vector<size_t> at;
  std::vector<std::string> flushed;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (calls[i].starts_with("flush ")) {
      at.push_back(i);
      flushed.push_back(calls[i]);
    }
  }
  ASSERT_EQ(static_cast<int>(at.size()), flushes) << when << ": " << absl::StrJoin(calls, ", ");
  if (at.empty()) return;
  EXPECT_EQ(at.back() - at.front() + 1, at.size())
      << when << ", a wait between two flushes: " << absl::StrJoin(calls, ", ");
  std::sort(flushed.begin(), flushed.end());
  EXPECT_EQ(std::unique(flushed.begin(), flushed.end()), flushed.end())
      << when << ": " << absl::StrJoin(calls, ", ");
}

// The devices' flushes run at once: a micro-batch that fills every shard's stash launches each
// shard's flush before it waits for any, and so does a pull that adds every replica's stash to
// dW. Serial flushes would leave k - 1 devices idle through each.
TEST_P(DeferredGradTest, TheDevicesFlushTogether) {
  MakeHead(absl::InfiniteDuration());
  const Placement& p = GetParam();
  std::vector<Sample> samples;
  calls_.Take();
  // 12 tokens each: the second overflows a stash of kStashTokens that holds the first. Sent one
  // at a time, replicas take one each (no stash fills); every shard holds a part of both.
  for (uint64_t i = 1; i <= 2; ++i) {
    samples.push_back(MakeSample(12, kV, p.dtype, 110 + i, "c", i));
    StepStats stats;
    ASSERT_TRUE(head_->Step(samples.back().mb, &stats).ok());
  }
  const int filled = p.sharded ? p.devices : (p.devices == 1 ? 1 : 0);
  ExpectFlushesTogether(calls_.Take(), filled, "the micro-batch that filled the stashes");
  const Pulled pulled = testing::Pull(*head_, /*reset=*/false);
  ExpectFlushesTogether(calls_.Take(), p.sharded ? p.devices : std::min(p.devices, 2), "the pull");
  EXPECT_EQ(pulled.summary.microbatch_count(), 2u);
  const std::vector<double> want = ReferenceWindow(samples);
  double scale = 0;
  for (double x : want) scale = std::max(scale, std::abs(x));
  ExpectClose(pulled.values, want, 1e-4 * scale, "dW after both flushes");
}

INSTANTIATE_TEST_SUITE_P(
    Placements, DeferredGradTest,
    ::testing::Values(Placement{1, v1::DTYPE_FP32}, Placement{1, v1::DTYPE_BF16},
                      Placement{2, v1::DTYPE_FP32}, Placement{2, v1::DTYPE_BF16},
                      Placement{2, v1::DTYPE_FP32, true}, Placement{2, v1::DTYPE_BF16, true},
                      Placement{3, v1::DTYPE_FP32, true}),
    Name);

}  // namespace
}  // namespace losshead::server
