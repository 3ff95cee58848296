// A key answers only what it was first used for: a repeat of (client id, sequence) with other
// hidden states, targets, options or loss options, or of (client id, step key) with other
// hyper-parameters, divisor or clipping, is ALREADY_EXISTS and changes nothing; the same content
// still replays, also after a checkpoint and a restore.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/durability/checkpoint.h"
#include "server/engine/head.h"
#include "tests/server/fp32_microbatch.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::FromBytes;
using testing::RandomFloats;

constexpr int64_t kV = 13, kD = 6, kN = 5;

class ReusedKeyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    head_ = Fresh();
    ASSERT_NE(head_, nullptr);
  }

  std::shared_ptr<Head> Fresh() {
    v1::HeadSpec spec = Fp32HeadSpec(kV, kD, 7);
    spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
    auto head = Head::Create(*backend_, spec, HeadOptions{});
    EXPECT_TRUE(head.ok()) << head.status();
    return head.ok() ? *head : nullptr;
  }

  static MicroBatch Batch(uint64_t seed, uint64_t sequence) {
    MicroBatch mb;
    mb.header.set_head("h");
    mb.header.set_client_id("c");
    mb.header.set_sequence(sequence);
    mb.header.set_num_tokens(kN);
    mb.header.set_hidden_dtype(v1::DTYPE_FP32);
    mb.header.set_target_dtype(v1::DTYPE_INT32);
    mb.hidden = Bytes(RandomFloats(kN * kD, seed));
    std::vector<int32_t> y(kN);
    for (int64_t i = 0; i < kN; ++i) y[i] = static_cast<int32_t>((seed + 5 * i) % kV);
    mb.targets = Bytes(y);
    return mb;
  }

  // Everything a wrongly answered repeat could have changed.
  struct State {
    v1::HeadInfo info;
    std::string gradient;
    std::string weights;
    bool operator==(const State& o) const {
      return info.tokens_total() == o.info.tokens_total() &&
             info.microbatches_total() == o.info.microbatches_total() &&
             info.tokens_since_pull() == o.info.tokens_since_pull() &&
             info.microbatches_since_pull() == o.info.microbatches_since_pull() &&
             info.weights_version() == o.info.weights_version() &&
             info.optimizer_step() == o.info.optimizer_step() && gradient == o.gradient &&
             weights == o.weights;
    }
  };
  static State Now(Head& head) {
    State s;
    s.info = head.Info();
    auto g = head.PullGradient(v1::DTYPE_FP32, false);
    auto w = head.DownloadWeights(v1::DTYPE_FP32);
    EXPECT_TRUE(g.ok() && w.ok());
    if (g.ok()) s.gradient = g->data;
    if (w.ok()) s.weights = w->data;
    return s;
  }

  static v1::ApplyOptimizerRequest Apply(uint64_t key) {
    v1::ApplyOptimizerRequest r;
    r.set_client_id("o");
    r.set_step_key(key);
    r.mutable_params()->set_lr(0.5);
    r.set_grad_divisor(4.0);
    r.set_max_norm(10.0);
    return r;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::shared_ptr<Head> head_;
};

TEST_F(ReusedKeyTest, ChangedHiddenTargetsOrOptionsAreAlreadyExistsAndCountNothing) {
  StepStats stats;
  const MicroBatch original = Batch(1, 1);
  auto first = head_->Step(original, &stats);
  ASSERT_TRUE(first.ok()) << first.status();
  const State counted = Now(*head_);
  EXPECT_EQ(counted.info.microbatches_total(), 1u);

  struct Change {
    const char* what;  // named in the error
    std::function<void(MicroBatch&)> edit;
  };
  const std::vector<Change> changes = {
      {"hidden", [](MicroBatch& mb) { mb.hidden = Batch(2, 1).hidden; }},
      {"hidden", [](MicroBatch& mb) { mb.hidden[3] ^= 1; }},  // one bit of one value
      {"targets", [](MicroBatch& mb) { mb.targets = Batch(2, 1).targets; }},
      {"options", [](MicroBatch& mb) { mb.header.mutable_options()->set_skip_grad_hidden(true); }},
      {"options",
       [](MicroBatch& mb) { mb.header.mutable_options()->set_return_per_token_loss(true); }},
      {"options",
       [](MicroBatch& mb) { mb.header.mutable_options()->set_expected_weights_version(1); }},
      {"loss_options",
       [](MicroBatch& mb) { mb.header.mutable_loss_options()->set_label_smoothing(0.25f); }},
      {"loss_options",
       [](MicroBatch& mb) { mb.header.mutable_loss_options()->set_ignore_index(2); }},
  };
  for (const Change& change : changes) {
    MicroBatch repeat = original;
    change.edit(repeat);
    StepStats s;
    auto got = head_->Step(repeat, &s);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kAlreadyExists) << change.what;
    const std::string message(got.status().message());
    EXPECT_NE(message.find("sequence 1 of client 'c'"), std::string::npos) << message;
    EXPECT_NE(message.find(change.what), std::string::npos) << message;
    EXPECT_FALSE(s.replayed);
    EXPECT_TRUE(Now(*head_) == counted) << change.what << ": the refusal changed the head";
  }
  // The same micro-batch still replays the first answer, bit for bit, and counts nothing.
  auto replay = head_->Step(original, &stats);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(stats.replayed);
  EXPECT_EQ((*replay)->grad_hidden, (*first)->grad_hidden);
  EXPECT_EQ((*replay)->loss_sum, (*first)->loss_sum);
  EXPECT_TRUE(Now(*head_) == counted);
}

TEST_F(ReusedKeyTest, TheSameMicroBatchSentAnotherWayStillReplays) {
  StepStats stats;
  MicroBatch mb = Batch(3, 2);
  ASSERT_TRUE(head_->Step(mb, &stats).ok());
  // The receiver's digests and a direct caller's are the same function of the bytes.
  mb.hidden_digest = ByteDigest::Of(mb.hidden);
  mb.targets_digest = ByteDigest::Of(mb.targets);
  ASSERT_TRUE(head_->Step(mb, &stats).ok());
  EXPECT_TRUE(stats.replayed);
  // Empty options sent, as one client library does, mean the same as options left out.
  mb.header.mutable_options();
  mb.header.mutable_loss_options();
  auto replay = head_->Step(mb, &stats);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(stats.replayed);
  // So does an empty set of hyper-parameters for an apply.
  v1::ApplyOptimizerRequest apply = Apply(1);
  apply.clear_params();
  ASSERT_TRUE(head_->ApplyOptimizer(apply).ok());
  apply.mutable_params();
  auto applied = head_->ApplyOptimizer(apply);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_TRUE(applied->replayed());
}

TEST_F(ReusedKeyTest, ForwardOnlyAndKeylessMicroBatchesAreNeverChecked) {
  StepStats stats;
  ASSERT_TRUE(head_->Step(Batch(1, 1), &stats).ok());
  // Forward-only bypasses the cache both ways: same key, other data, computed.
  MicroBatch forward = Batch(2, 1);
  forward.header.mutable_options()->set_forward_only(true);
  auto f = head_->Step(forward, &stats);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->forward_only);
  MicroBatch keyless = Batch(2, 1);
  keyless.header.clear_client_id();
  EXPECT_TRUE(head_->Step(keyless, &stats).ok());
  EXPECT_EQ(head_->Info().microbatches_total(), 2u);
}

TEST_F(ReusedKeyTest, ChangedApplyIsAlreadyExistsAndStepsNothing) {
  StepStats stats;
  ASSERT_TRUE(head_->Step(Batch(1, 1), &stats).ok());
  auto first = head_->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(head_->Step(Batch(2, 2), &stats).ok());  // a window the repeats must not take
  const State stepped = Now(*head_);
  struct Change {
    const char* what;
    std::function<void(v1::ApplyOptimizerRequest&)> edit;
  };
  const std::vector<Change> changes = {
      {"params", [](auto& r) { r.mutable_params()->set_lr(0.25); }},
      {"params", [](auto& r) { r.mutable_params()->set_weight_decay(0.1); }},
      {"grad_divisor", [](auto& r) { r.set_grad_divisor(8.0); }},
      {"grad_divisor", [](auto& r) { r.clear_grad_divisor(); }},
      {"max_norm", [](auto& r) { r.clear_max_norm(); }},
      {"trunk_grad_sq_norm", [](auto& r) { r.set_trunk_grad_sq_norm(2.0); }},
      {"expected_weights_version", [](auto& r) { r.set_expected_weights_version(2); }},
  };
  for (const Change& change : changes) {
    v1::ApplyOptimizerRequest repeat = Apply(1);
    change.edit(repeat);
    auto got = head_->ApplyOptimizer(repeat);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kAlreadyExists) << change.what;
    const std::string message(got.status().message());
    EXPECT_NE(message.find("step_key 1 of client 'o'"), std::string::npos) << message;
    EXPECT_NE(message.find(change.what), std::string::npos) << message;
    EXPECT_TRUE(Now(*head_) == stepped) << change.what;
  }
  auto replay = head_->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_TRUE(Now(*head_) == stepped);
}

TEST_F(ReusedKeyTest, FingerprintsSurviveACheckpointAndARestore) {
  StepStats stats;
  const MicroBatch original = Batch(1, 1);
  ASSERT_TRUE(head_->Step(original, &stats).ok());
  ASSERT_TRUE(head_->ApplyOptimizer(Apply(1)).ok());
  auto snap = head_->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  auto decoded = DecodeCheckpoint(EncodeCheckpoint(*snap));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  auto restored = Head::Restore(*backend_, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();
  const State before = Now(**restored);

  MicroBatch changed = original;
  changed.targets = Batch(2, 1).targets;
  EXPECT_EQ((*restored)->Step(changed, &stats).status().code(), absl::StatusCode::kAlreadyExists);
  v1::ApplyOptimizerRequest apply = Apply(1);
  apply.mutable_params()->set_lr(0.125);
  EXPECT_EQ((*restored)->ApplyOptimizer(apply).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(Now(**restored) == before);

  ASSERT_TRUE((*restored)->Step(original, &stats).ok());
  EXPECT_TRUE(stats.replayed);
  auto replay = (*restored)->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_TRUE(Now(**restored) == before);
}

}  // namespace
}  // namespace losshead::server
