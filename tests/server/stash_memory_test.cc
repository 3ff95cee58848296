// The deferred-dW stash only speeds micro-batches up, so it never stands in the way of memory
// something needs: a new head, an optimizer's state, a larger micro-batch's buffers. On a device
// that is full, the stash is added to dW and freed, nothing counted is lost, and the head adds to
// dW directly until a deleted head frees memory there; what does not fit even so is refused and
// changes nothing. A micro-batch short of memory takes back its own head's stash first, then
// those of other heads at rest on the device. A stash that gave way is tried again once a head's
// memory on its device is freed (when the last work holding a deleted head ends). A CPU backend
// with a memory limit stands in for the device.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"
#include "tests/server/faulty_backend.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::FaultyBackend;
using testing::kD;
using testing::MakeSample;
using testing::Pull;
using testing::ReferenceMean;
using testing::Sample;

constexpr int64_t kV = 29;
constexpr int64_t kStashTokens = 32;
constexpr size_t kRoomy = size_t{1} << 30;

std::unique_ptr<FaultyBackend> LimitedDevice(size_t bytes) {
  auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  auto device = std::make_unique<FaultyBackend>(std::move(*cpu));
  device->LimitMemory(bytes);
  return device;
}

v1::HeadSpec Spec(const std::string& name, int64_t vocab) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(vocab);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(3);
  return spec;
}

size_t StashBytes(kernels::Backend& device) {
  const kernels::Problem shape{.n = 1, .d = kD, .v = kV, .dtype = kernels::DType::kFP32};
  absl::StatusOr<size_t> bytes = device.GradStashBytes(shape, kStashTokens);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.value_or(0);
}

HeadOptions WithStash(size_t stash_bytes) {
  return HeadOptions{.grad_stash_bytes = stash_bytes, .grad_stash_idle = absl::InfiniteDuration()};
}

Sample Micro(const std::string& head, int64_t n, uint64_t sequence) {
  Sample s = MakeSample(n, kV, v1::DTYPE_FP32, 500 + sequence, "c", sequence);
  s.mb.header.set_head(head);
  return s;
}

// dW of `head` against the fp64 dW of `samples` (W as created: `w`).
void ExpectWindow(Head& head, const std::vector<float>& w, const std::vector<Sample>& samples,
                  const std::string& what) {
  std::vector<double> want(kV * kD, 0.0);
  for (const Sample& s : samples) {
    const auto r = ReferenceMean(s.hidden, w, s.targets, s.mb.header.num_tokens(), kD, kV);
    for (size_t i = 0; i < want.size(); ++i) want[i] += r.grad_weight[i];
  }
  const testing::Pulled pulled = Pull(head, /*reset=*/false);
  EXPECT_EQ(pulled.summary.microbatch_count(), samples.size()) << what;
  testing::ExpectClose(pulled.values, want, 1e-4, what);
}

absl::Status StepOnce(Head& head, const Sample& s) {
  StepStats stats;
  return head.Step(s.mb, &stats).status();
}

// The device bytes a one-device head of kV rows takes once it has run a micro-batch of 2 tokens,
// and what a micro-batch of 64 then adds, without a stash.
struct Footprint {
  size_t after_small = 0;
  size_t big_adds = 0;
};

Footprint MeasureFootprint() {
  std::unique_ptr<FaultyBackend> device = LimitedDevice(kRoomy);
  auto head = Head::Create(*device, Spec("h", kV), HeadOptions{});
  EXPECT_TRUE(head.ok()) << head.status();
  if (!head.ok()) return {};
  Footprint f;
  EXPECT_TRUE(StepOnce(**head, Micro("h", 2, 1)).ok());
  f.after_small = device->allocated();
  EXPECT_TRUE(StepOnce(**head, Micro("h", 64, 2)).ok());
  f.big_adds = device->allocated() - f.after_small;
  return f;
}

TEST(StashMemoryTest, ANewHeadThatNeedsTheMemoryGetsTheOtherHeadsStash) {
  std::unique_ptr<FaultyBackend> device = LimitedDevice(size_t{1} << 20);
  const size_t stash = StashBytes(*device);
  HeadRegistry registry(*device, WithStash(stash));
  auto a = registry.Create(Spec("a", kV));
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<float> w = testing::Decode(testing::Weights(**a), v1::DTYPE_FP32);
  std::vector<Sample> samples = {Micro("a", 6, 1), Micro("a", 7, 2)};
  for (const Sample& s : samples) ASSERT_TRUE(StepOnce(**a, s).ok());
  const size_t workspace = (*a)->workspace_bytes();
  ASSERT_GE(workspace, stash);
  EXPECT_EQ(device->flushes.load(), 0);  // both micro-batches sit in the stash

  const size_t free = device->memory_info().free_bytes;
  const size_t row_bytes = kD * (sizeof(float) + sizeof(float));  // W and dW
  // A head that would not fit even without the stash is refused, and the stash stays.
  auto huge = registry.Create(Spec("huge", static_cast<int64_t>((free + stash) / row_bytes) + 1));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_EQ((*a)->workspace_bytes(), workspace);
  EXPECT_EQ(device->flushes.load(), 0);

  // Head b needs more than is free, and less than is free once a's stash is back.
  const int64_t rows = static_cast<int64_t>((free + stash / 2) / row_bytes);
  ASSERT_GT(rows * row_bytes, free);
  ASSERT_LE(rows * row_bytes, free + stash);
  auto b = registry.Create(Spec("b", rows));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->workspace_bytes(), workspace - stash);
  EXPECT_EQ(device->flushes.load(), 1);

  // Nothing a counted is lost, and its next micro-batches add to dW as they run.
  ExpectWindow(**a, w, samples, "a's dW once its stash is gone");
  for (uint64_t seq = 3; seq <= 4; ++seq) {
    samples.push_back(Micro("a", 5, seq));
    ASSERT_TRUE(StepOnce(**a, samples.back()).ok());
  }
  EXPECT_EQ(device->flushes.load(), 1);
  EXPECT_EQ((*a)->workspace_bytes(), workspace - stash);
  ExpectWindow(**a, w, samples, "a's dW after more micro-batches");

  // b is deleted while something (here the test) still holds it: its memory stays, and a goes on
  // without a stash.
  ASSERT_TRUE(registry.Delete("b").ok());
  samples.push_back(Micro("a", 5, 5));
  ASSERT_TRUE(StepOnce(**a, samples.back()).ok());
  EXPECT_EQ((*a)->workspace_bytes(), workspace - stash);
  // Once b's memory is freed, a takes a stash again at its next micro-batch.
  b->reset();
  samples.push_back(Micro("a", 5, 6));
  ASSERT_TRUE(StepOnce(**a, samples.back()).ok());
  EXPECT_EQ((*a)->workspace_bytes(), workspace);
  EXPECT_EQ(device->flushes.load(), 1);
  ExpectWindow(**a, w, samples, "a's dW with its stash back");  // the pull flushes it
  EXPECT_EQ(device->flushes.load(), 2);
}

TEST(StashMemoryTest, AnOptimizerThatNeedsTheMemoryGetsTheStash) {
  std::unique_ptr<FaultyBackend> device = LimitedDevice(kRoomy);
  const size_t stash = StashBytes(*device);
  HeadRegistry registry(*device, WithStash(stash));
  auto a = registry.Create(Spec("a", kV));
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<float> w = testing::Decode(testing::Weights(**a), v1::DTYPE_FP32);
  const std::vector<Sample> samples = {Micro("a", 6, 1)};
  ASSERT_TRUE(StepOnce(**a, samples[0]).ok());
  // Momentum SGD keeps one fp32 buffer of V x D: room for it only once the stash is back.
  const size_t momentum = kV * kD * sizeof(float);
  ASSERT_LT(momentum, stash);
  device->LimitMemory(device->allocated() + momentum - 1);
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OPTIMIZER_SGD);
  sgd.set_momentum_buffer(true);
  auto set = registry.SetOptimizer("a", sgd);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*a)->Info().spec().optimizer().kind(), v1::OPTIMIZER_SGD);
  ExpectWindow(**a, w, samples, "dW once the stash is gone");
}

TEST(StashMemoryTest, ALargerMicroBatchThatNeedsTheMemoryGetsItsHeadsStash) {
  const Footprint f = MeasureFootprint();
  ASSERT_GT(f.big_adds, 0u);
  std::unique_ptr<FaultyBackend> probe = LimitedDevice(kRoomy);
  const size_t stash = StashBytes(*probe);
  ASSERT_LT(stash / 2, f.big_adds);
  // After the small micro-batch, the big one finds half a stash too little free.
  std::unique_ptr<FaultyBackend> device =
      LimitedDevice(f.after_small + stash + f.big_adds - stash / 2);
  auto head = Head::Create(*device, Spec("h", kV), WithStash(stash));
  ASSERT_TRUE(head.ok()) << head.status();
  const std::vector<float> w = testing::Decode(testing::Weights(**head), v1::DTYPE_FP32);
  const std::vector<Sample> samples = {Micro("h", 2, 1), Micro("h", 64, 2)};
  ASSERT_TRUE(StepOnce(**head, samples[0]).ok());
  ASSERT_EQ(device->allocated(), f.after_small + stash);
  ASSERT_TRUE(StepOnce(**head, samples[1]).ok());
  EXPECT_EQ(device->allocated(), f.after_small + f.big_adds);
  EXPECT_EQ(device->flushes.load(), 1);
  ExpectWindow(**head, w, samples, "dW of both micro-batches");
}

TEST(StashMemoryTest, ALargerMicroBatchThatNeedsTheMemoryGetsAnotherHeadsStash) {
  const Footprint f = MeasureFootprint();
  std::unique_ptr<FaultyBackend> probe = LimitedDevice(kRoomy);
  const size_t stash = StashBytes(*probe);
  ASSERT_LT(stash / 2, f.big_adds);
  std::unique_ptr<FaultyBackend> device = LimitedDevice(kRoomy);
  HeadRegistry registry(*device, WithStash(stash));
  auto a = registry.Create(Spec("a", kV));
  auto b = registry.Create(Spec("b", kV));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  const std::vector<float> w = testing::Decode(testing::Weights(**a), v1::DTYPE_FP32);
  ASSERT_EQ(testing::Decode(testing::Weights(**b), v1::DTYPE_FP32), w);  // the same init
  std::vector<Sample> at_a = {Micro("a", 6, 1), Micro("a", 7, 2)};
  for (const Sample& s : at_a) ASSERT_TRUE(StepOnce(**a, s).ok());
  const size_t workspace = (*a)->workspace_bytes();
  ASSERT_GE(workspace, stash);

  // b's first micro-batch finds room for its buffers but not for a stash of its own...
  const size_t small_buffers = f.after_small - kV * kD * 2 * sizeof(float);  // less W and dW
  device->LimitMemory(device->allocated() + small_buffers + stash - 1);
  std::vector<Sample> at_b = {Micro("b", 2, 1)};
  ASSERT_TRUE(StepOnce(**b, at_b[0]).ok());
  ASSERT_EQ((*b)->workspace_bytes() + kV * kD * 2 * sizeof(float), f.after_small);
  // ...and its larger one half a stash too little: a's idle stash makes up the difference.
  device->LimitMemory(device->allocated() + f.big_adds - stash / 2);
  at_b.push_back(Micro("b", 64, 2));
  ASSERT_TRUE(StepOnce(**b, at_b[1]).ok());
  EXPECT_EQ((*a)->workspace_bytes(), workspace - stash);
  EXPECT_EQ(device->flushes.load(), 1);

  // Nothing a counted is lost, and it goes on adding to dW directly.
  at_a.push_back(Micro("a", 5, 3));
  ASSERT_TRUE(StepOnce(**a, at_a.back()).ok());
  EXPECT_EQ(device->flushes.load(), 1);
  ExpectWindow(**a, w, at_a, "a's dW once b took its stash");
  ExpectWindow(**b, w, at_b, "b's dW");
}

TEST(StashMemoryTest, AMicroBatchThatDoesNotFitEvenWithoutTheStashChangesNothing) {
  const Footprint f = MeasureFootprint();
  std::unique_ptr<FaultyBackend> probe = LimitedDevice(kRoomy);
  const size_t stash = StashBytes(*probe);
  ASSERT_LT(stash, f.big_adds);
  // Nothing is free after the small micro-batch, and the stash is less than the big one adds.
  std::unique_ptr<FaultyBackend> device = LimitedDevice(f.after_small + stash);
  auto head = Head::Create(*device, Spec("h", kV), WithStash(stash));
  ASSERT_TRUE(head.ok()) << head.status();
  const std::vector<float> w = testing::Decode(testing::Weights(**head), v1::DTYPE_FP32);
  std::vector<Sample> samples = {Micro("h", 2, 1)};
  ASSERT_TRUE(StepOnce(**head, samples[0]).ok());
  const absl::Status big = StepOnce(**head, Micro("h", 64, 2));
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  const v1::HeadInfo info = (*head)->Info();
  EXPECT_EQ(info.microbatches_total(), 1u);
  EXPECT_EQ(info.tokens_total(), static_cast<uint64_t>(samples[0].tokens));
  ExpectWindow(**head, w, samples, "dW after the refusal");
  // The same key with a micro-batch that fits is taken: the refusal spent nothing.
  samples.push_back(Micro("h", 2, 2));
  ASSERT_TRUE(StepOnce(**head, samples.back()).ok());
  ExpectWindow(**head, w, samples, "dW after the retry");
}

}  // namespace
}  // namespace losshead::server
