// A head sharded over k devices by vocabulary rows answers as the one-device head of the same spec
// up to summation order: every micro-batch runs on all shards, which combine their softmax
// statistics per token chunk and sum their parts of dH. Loss, dH, the gradient window (under
// concurrent streams, across pulls and resets), pushes, downloads, the optimizer (each shard
// stepping its own rows) and checkpoints (the one-device file, restored on any placement) are
// checked against the one-device head and an fp64 reference. CPU backends stand in for the
// devices, with the host collective between them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::Decode;
using testing::Encode;
using testing::ExpectClose;
using testing::FromBytes;
using testing::kD;
using testing::KernelDType;
using testing::MakeSample;
using testing::Pull;
using testing::Pulled;
using testing::RandomFloats;
using testing::ReferenceMean;
using testing::Sample;
using testing::Weights;

v1::HeadSpec Spec(int64_t v, v1::DType dtype, int shards,
                  v1::OptimizerKind optimizer = v1::OPTIMIZER_NONE) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(v);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  spec.mutable_optimizer()->set_kind(optimizer);
  if (shards > 0) {
    spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
    spec.mutable_placement()->set_devices(shards);
  }
  return spec;
}



std::shared_ptr<const StepOutcome> StepOk(Head& head, const MicroBatch& mb) {
  StepStats stats;
  auto out = head.Step(mb, &stats);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : nullptr;
}

// One micro-batch's answers from the sharded and the one-device head: the same counts, loss and
// dH up to summation order (dH within one ulp of the head's dtype).
void ExpectCloseOutcome(const std::shared_ptr<const StepOutcome>& got,
                        const std::shared_ptr<const StepOutcome>& want, v1::DType dtype,
                        const std::string& what) {
  ASSERT_NE(got, nullptr) << what;
  ASSERT_NE(want, nullptr) << what;
  EXPECT_EQ(got->token_count, want->token_count) << what;
  EXPECT_EQ(got->weights_version, want->weights_version) << what;
  EXPECT_NEAR(got->loss, want->loss, 1e-5 * std::max(1.0, std::abs(want->loss))) << what;
  const std::vector<float> dh = Decode(got->grad_hidden, dtype);
  const std::vector<float> dh_want = Decode(want->grad_hidden, dtype);
  double scale = 0;
  for (float x : dh_want) scale = std::max(scale, static_cast<double>(std::abs(x)));
  // fp32: summation order, amplified where terms cancel, judged at the tensor's scale; bf16: one
  // ulp, as the sums may round apart.
  if (dtype == v1::DTYPE_BF16) {
    ExpectClose(dh, dh_want, 0x1p-7, what + " dH", 1e-2 * scale);
  } else {
    ExpectClose(dh, dh_want, 1e-4, what + " dH", scale);
  }
}



// A sharded head beside a one-device head of the same spec, k CPU devices for the shards.
struct Pair {
  std::vector<std::unique_ptr<kernels::Backend>> owned;
  std::vector<kernels::Backend*> devices;
  std::shared_ptr<Head> sharded;
  std::shared_ptr<Head> single;
};

void MakePair(int k, int64_t v, v1::DType dtype, v1::OptimizerKind optimizer, Pair* pair) {
  for (int r = 0; r <= k; ++r) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    pair->owned.push_back(std::move(*backend));
  }
  for (int r = 0; r < k; ++r) pair->devices.push_back(pair->owned[r].get());
  auto sharded = Head::Create(pair->devices, Spec(v, dtype, k, optimizer), HeadOptions{});
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  pair->sharded = *sharded;
  auto single = Head::Create(*pair->owned[k], Spec(v, dtype, 0, optimizer), HeadOptions{});
  ASSERT_TRUE(single.ok()) << single.status();
  pair->single = *single;
  // The same seed gives the same W, each shard holding its rows of it.
  ASSERT_EQ(Weights(*pair->sharded), Weights(*pair->single));
}

struct Case {
  int k;
  int64_t v;
  v1::DType dtype;
};

class ShardedHeadTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(
        MakePair(GetParam().k, GetParam().v, GetParam().dtype, v1::OPTIMIZER_NONE, &pair_));
  }
  Head& sharded() { return *pair_.sharded; }
  Head& single() { return *pair_.single; }
  Pair pair_;
};

TEST_P(ShardedHeadTest, ConcurrentStreamsMatchTheOneDeviceHead) {
  const Case& c = GetParam();
  const std::vector<float> w = Decode(Weights(single()), c.dtype);
  const size_t esize = kernels::DTypeSize(KernelDType(c.dtype));

  // 4 streams of 5 micro-batches of 1 to 29 tokens, sent to both heads at once.
  std::vector<std::vector<Sample>> streams(4);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 5; ++i) {
      streams[t].push_back(MakeSample(1 + (t * 11 + i * 7) % 29, c.v, c.dtype, 2000 + 100 * t + i,
                                      absl::StrCat("c", t), i + 1));
    }
  }
  std::vector<std::vector<std::shared_ptr<const StepOutcome>>> got(4), want(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (const Sample& s : streams[t]) {
        got[t].push_back(StepOk(sharded(), s.mb));
        want[t].push_back(StepOk(single(), s.mb));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<double> window(static_cast<size_t>(c.v * kD), 0.0);
  uint64_t tokens = 0;
  for (int t = 0; t < 4; ++t) {
    for (size_t i = 0; i < streams[t].size(); ++i) {
      ExpectCloseOutcome(got[t][i], want[t][i], c.dtype, absl::StrCat("stream ", t, ", ", i));
      const Sample& s = streams[t][i];
      const auto r = ReferenceMean(s.hidden, w, s.targets, s.mb.header.num_tokens(), kD, c.v);
      for (size_t j = 0; j < window.size(); ++j) window[j] += r.grad_weight[j];
      tokens += s.tokens;
      // The loss against fp64 too (the one-device head is no oracle).
      ASSERT_NE(got[t][i], nullptr);
      EXPECT_NEAR(got[t][i]->loss_sum, r.loss_sum, 1e-4 * std::max(1.0, std::abs(r.loss_sum)));
    }
  }

  // Each shard holds its rows of W and dW only.
  const v1::HeadInfo info = sharded().Info();
  EXPECT_EQ(info.spec().placement().kind(), v1::PLACEMENT_SHARDED);
  EXPECT_EQ(info.spec().placement().devices(), static_cast<uint32_t>(c.k));
  ASSERT_EQ(info.device_memory_size(), c.k);
  for (int r = 0; r < c.k; ++r) {
    const uint64_t rows = kernels::ShardRange(c.v, c.k, r).size();
    EXPECT_EQ(info.device_memory(r).weights_bytes(), rows * kD * esize) << "shard " << r;
    EXPECT_EQ(info.device_memory(r).gradient_bytes(), rows * kD * 4) << "shard " << r;
    EXPECT_GT(info.device_memory(r).workspace_bytes(), 0u) << "shard " << r;
  }
  EXPECT_EQ(info.memory().weights_bytes(), c.v * kD * esize);

  // The window: counters exact, dW up to summation order; pulling again counts nothing twice.
  const Pulled first = Pull(sharded(), false);
  const Pulled one = Pull(single(), false);
  EXPECT_EQ(first.summary.token_count(), tokens);
  EXPECT_EQ(first.summary.microbatch_count(), 20u);
  EXPECT_EQ(first.summary.token_count(), one.summary.token_count());
  ExpectClose(first.values, one.values, 1e-5, "dW vs one device");
  ExpectClose(first.values, window, 1e-5, "dW vs fp64");
  const Pulled reset = Pull(sharded(), true);
  EXPECT_EQ(reset.values, first.values);
  EXPECT_EQ(reset.summary.token_count(), tokens);
  const Pulled empty = Pull(sharded(), false);
  EXPECT_EQ(empty.summary.microbatch_count(), 0u);
  EXPECT_EQ(empty.values, std::vector<float>(empty.values.size(), 0.0f));
  EXPECT_EQ(sharded().Info().tokens_total(), tokens);
}

TEST_P(ShardedHeadTest, PushesAndForwardOnlyStepsReachEveryShard) {
  const Case& c = GetParam();
  const size_t count = static_cast<size_t>(c.v * kD);
  const std::vector<float> pushed = RandomFloats(count, 77, 0.3f);
  auto vs = sharded().PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), 1);
  auto vo = single().PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), 1);
  ASSERT_TRUE(vs.ok() && vo.ok()) << vs.status() << vo.status();
  EXPECT_EQ(*vs, 2u);
  EXPECT_EQ(Weights(sharded()), Encode(pushed, c.dtype));
  const std::string delta = Encode(RandomFloats(count, 78, 0.05f), v1::DTYPE_BF16);
  ASSERT_TRUE(sharded().PushWeights(v1::DTYPE_BF16, v1::PUSH_MODE_ADD, delta, 2).ok());
  ASSERT_TRUE(single().PushWeights(v1::DTYPE_BF16, v1::PUSH_MODE_ADD, delta, 2).ok());
  EXPECT_EQ(Weights(sharded()), Weights(single()));
  std::vector<float> poisoned = pushed;
  poisoned[count - 1] = std::nanf("");
  EXPECT_EQ(sharded()
                .PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_ADD, Bytes(poisoned), std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Weights(sharded()), Weights(single()));

  // A counted step, then the same micro-batch forward-only: the same answer, nothing added.
  const Sample s = MakeSample(23, c.v, c.dtype, 600, "f", 1);
  auto counted = StepOk(sharded(), s.mb);
  ExpectCloseOutcome(counted, StepOk(single(), s.mb), c.dtype, "counted");
  const Pulled before = Pull(sharded(), false);
  MicroBatch forward = s.mb;
  forward.header.mutable_options()->set_forward_only(true);
  auto evaluated = StepOk(sharded(), forward);
  ASSERT_NE(evaluated, nullptr);
  ASSERT_NE(counted, nullptr);
  EXPECT_TRUE(evaluated->forward_only);
  EXPECT_EQ(evaluated->loss_sum, counted->loss_sum);
  EXPECT_EQ(evaluated->grad_hidden, counted->grad_hidden);
  const Pulled after = Pull(sharded(), false);
  EXPECT_EQ(after.summary.microbatch_count(), before.summary.microbatch_count());
  EXPECT_EQ(after.values, before.values);
  EXPECT_EQ(after.summary.min_weights_version(), 3u);
}

INSTANTIATE_TEST_SUITE_P(ShardedOver, ShardedHeadTest,
                         ::testing::Values(Case{2, 37, v1::DTYPE_BF16}, Case{3, 41, v1::DTYPE_FP32},
                                           Case{3, 37, v1::DTYPE_BF16},
                                           Case{2, 41, v1::DTYPE_FP32}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat(
                               "k", info.param.k, "_v", info.param.v,
                               info.param.dtype == v1::DTYPE_BF16 ? "_bf16" : "_fp32");
                         });

// AdamW on a bf16 head sharded three ways: each shard steps its rows with its own state; norms
// and W agree with the one-device head's.
TEST(ShardedHeadOptimizerTest, AdamWStepsLikeOneDevice) {
  constexpr int kK = 3;
  constexpr int64_t kV = 37;
  Pair pair;
  ASSERT_NO_FATAL_FAILURE(MakePair(kK, kV, v1::DTYPE_BF16, v1::OPTIMIZER_ADAMW, &pair));
  uint64_t sequence = 0;
  for (uint64_t key = 1; key <= 3; ++key) {
    for (int i = 0; i < 3; ++i) {
      ++sequence;
      const Sample s = MakeSample(4 + 5 * i, kV, v1::DTYPE_BF16, 900 + sequence, "c", sequence);
      auto got = StepOk(*pair.sharded, s.mb);
      auto want = StepOk(*pair.single, s.mb);
      ASSERT_NE(got, nullptr);
      ASSERT_NE(want, nullptr);
      EXPECT_NEAR(got->loss, want->loss, 1e-3);
    }
    v1::ApplyOptimizerRequest request;
    request.set_client_id("opt");
    request.set_step_key(key);
    request.mutable_params()->set_lr(0.02);
    request.mutable_params()->set_beta1(0.9);
    request.mutable_params()->set_beta2(0.999);
    request.mutable_params()->set_eps(1e-8);
    request.mutable_params()->set_weight_decay(0.01);
    if (key == 2) request.set_max_norm(0.05);
    auto r = pair.sharded->ApplyOptimizer(request);
    auto w = pair.single->ApplyOptimizer(request);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_NEAR(r->head_grad_norm(), w->head_grad_norm(), 1e-4 * w->head_grad_norm());
    EXPECT_NEAR(r->clip_coefficient(), w->clip_coefficient(), 1e-4);
    if (key == 2) EXPECT_LT(r->clip_coefficient(), 1.0);
    EXPECT_EQ(r->window().token_count(), w->window().token_count());
    EXPECT_EQ(r->optimizer_step(), key);
    const std::vector<float> ws = Decode(Weights(*pair.sharded), v1::DTYPE_BF16);
    const std::vector<float> wo = Decode(Weights(*pair.single), v1::DTYPE_BF16);
    ExpectClose(ws, wo, 0x1p-7, absl::StrCat("W after step ", key), 1e-3);
    const Pulled left = Pull(*pair.sharded, false);
    EXPECT_EQ(left.values, std::vector<float>(left.values.size(), 0.0f));
  }
  const v1::HeadInfo info = pair.sharded->Info();
  for (int r = 0; r < kK; ++r) {
    const uint64_t rows = kernels::ShardRange(kV, kK, r).size();
    EXPECT_EQ(info.device_memory(r).optimizer_state_bytes(), rows * kD * 4 * 2) << r;
    EXPECT_EQ(info.device_memory(r).master_weights_bytes(), rows * kD * 4) << r;
  }
}

// The checkpoint of a sharded head is the one-device file: restored sharded on 2, and on one
// device, with the same W, window and optimizer; a one-device checkpoint restores sharded too.
TEST(ShardedHeadCheckpointTest, RestoresOnAnyPlacement) {
  constexpr int64_t kV = 41;
  Pair pair;
  ASSERT_NO_FATAL_FAILURE(MakePair(3, kV, v1::DTYPE_FP32, v1::OPTIMIZER_ADAMW, &pair));
  Head& original = *pair.sharded;
  v1::ApplyOptimizerRequest apply;
  apply.set_client_id("opt");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(0.02);
  apply.mutable_params()->set_beta1(0.9);
  apply.mutable_params()->set_beta2(0.999);
  apply.mutable_params()->set_eps(1e-8);
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    const Sample s = MakeSample(4 + 3 * seq, kV, v1::DTYPE_FP32, 3000 + seq, "c", seq);
    StepOk(original, s.mb);
    StepOk(*pair.single, s.mb);
    if (seq == 3) {
      auto stepped = original.ApplyOptimizer(apply);
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      ASSERT_TRUE(pair.single->ApplyOptimizer(apply).ok());
    }
  }
  auto snap = original.Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  auto snap_one = pair.single->Snapshot();
  ASSERT_TRUE(snap_one.ok()) << snap_one.status();
  EXPECT_EQ(snap->spec.placement().kind(), v1::PLACEMENT_SHARDED);
  ExpectClose(FromBytes<float>(snap->weights), FromBytes<float>(snap_one->weights), 1e-5,
              "snapshot W vs one device", 1e-3);
  const Pulled window = Pull(original, false);

  std::vector<std::unique_ptr<kernels::Backend>> backends;
  for (int i = 0; i < 3; ++i)
    backends.push_back(*kernels::CreateBackend(kernels::BackendKind::kCpu));
  kernels::Backend* const two[] = {backends[0].get(), backends[1].get()};
  auto on_two = Head::Restore(two, *snap, HeadOptions{});
  ASSERT_TRUE(on_two.ok()) << on_two.status();
  auto on_one = Head::Restore(*backends[2], *snap, HeadOptions{});
  ASSERT_TRUE(on_one.ok()) << on_one.status();
  for (const auto& [restored, k] : {std::pair{*on_two, 2}, std::pair{*on_one, 1}}) {
    const std::string what = absl::StrCat("restored on ", k);
    EXPECT_EQ(restored->device_count(), k) << what;
    EXPECT_EQ(restored->Info().spec().placement().kind(), v1::PLACEMENT_SHARDED) << what;
    EXPECT_EQ(Weights(*restored), snap->weights) << what;
    const Pulled pulled = Pull(*restored, false);
    EXPECT_EQ(pulled.values, window.values) << what;
    EXPECT_EQ(pulled.summary.token_count(), window.summary.token_count()) << what;
    auto again = restored->Snapshot();
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_EQ(again->optimizer_state.size(), snap->optimizer_state.size()) << what;
    for (size_t b = 0; b < snap->optimizer_state.size(); ++b) {
      EXPECT_EQ(FromBytes<float>(again->optimizer_state[b]),
                FromBytes<float>(snap->optimizer_state[b]))
          << what << ", state " << b;
    }
    EXPECT_EQ(again->optimizer_step, 1u) << what;
  }
  // The one-device head's file, restored sharded three ways.
  snap_one->spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
  kernels::Backend* const three[] = {backends[0].get(), backends[1].get(), backends[2].get()};
  auto sharded_from_one = Head::Restore(three, *snap_one, HeadOptions{});
  ASSERT_TRUE(sharded_from_one.ok()) << sharded_from_one.status();
  EXPECT_EQ(Weights(**sharded_from_one), snap_one->weights);
  EXPECT_EQ(Pull(**sharded_from_one, false).values, FromBytes<float>(snap_one->gradient));
}

TEST(ShardedHeadPlacementTest, RefusesWhatDoesNotFit) {
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  std::vector<kernels::Backend*> three;
  for (int i = 0; i < 3; ++i) {
    backends.push_back(*kernels::CreateBackend(kernels::BackendKind::kCpu));
    three.push_back(backends.back().get());
  }
  auto code = [&](const v1::HeadSpec& spec) {
    return Head::Create(three, spec, HeadOptions{}).status().code();
  };
  // Each shard owns at least one row; the count must be the devices given.
  EXPECT_EQ(code(Spec(2, v1::DTYPE_FP32, 3)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Spec(37, v1::DTYPE_FP32, 2)), absl::StatusCode::kInvalidArgument);
  v1::HeadSpec all = Spec(37, v1::DTYPE_FP32, 3);
  all.mutable_placement()->set_devices(0);  // every device
  auto head = Head::Create(three, all, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->device_count(), 3);
  EXPECT_EQ((*head)->Info().spec().placement().devices(), 3u);
  // A micro-batch with a target outside the vocabulary is refused whole, on every shard.
  Sample bad = MakeSample(5, 37, v1::DTYPE_FP32, 1, "", 0);
  std::vector<int32_t> targets = bad.targets;
  targets[4] = 37;
  bad.mb.targets = Bytes(targets);
  StepStats stats;
  EXPECT_EQ((*head)->Step(bad.mb, &stats).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*head)->Info().microbatches_total(), 0u);
}

}  // namespace
}  // namespace losshead::server
