// Head semantics against the CPU backend: validation codes, results, replay, pull/reset, push.
#include "server/engine/head.h"

#include <cmath>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head_registry.h"
#include "server/engine/pinned_pool.h"
#include "server/engine/result_pool.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::FromBytes;
using testing::RandomFloats;

constexpr int64_t kV = 11;
constexpr int64_t kD = 6;

class HeadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    registry_ = std::make_unique<HeadRegistry>(*backend_, HeadOptions{.idempotency_window = 2});
  }

  v1::HeadSpec Spec(const std::string& name, v1::DType dtype = v1::DTYPE_FP32) {
    v1::HeadSpec spec;
    spec.set_name(name);
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(dtype);
    spec.mutable_init()->mutable_normal()->set_std(0.5f);
    spec.mutable_init()->mutable_normal()->set_seed(42);
    return spec;
  }

  std::shared_ptr<Head> Create(const std::string& name, v1::DType dtype = v1::DTYPE_FP32) {
    auto head = registry_->Create(Spec(name, dtype));
    EXPECT_TRUE(head.ok()) << head.status();
    return head.ok() ? *head : nullptr;
  }

  MicroBatch Batch(int64_t n, uint64_t seed, const std::string& client = "",
                   uint64_t sequence = 0) {
    MicroBatch mb;
    mb.header.set_head("h");
    mb.header.set_client_id(client);
    mb.header.set_sequence(sequence);
    mb.header.set_num_tokens(n);
    mb.header.set_hidden_dtype(v1::DTYPE_FP32);
    mb.header.set_target_dtype(v1::DTYPE_INT32);
    mb.hidden = Bytes(RandomFloats(n * kD, seed));
    std::vector<int32_t> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<int32_t>((seed + 3 * i) % kV);
    mb.targets = Bytes(y);
    return mb;
  }

  static std::vector<float> Weights(Head& head) {
    auto w = head.DownloadWeights(v1::DTYPE_FP32);
    EXPECT_TRUE(w.ok());
    return FromBytes<float>(w->data);
  }

  static std::vector<float> Grad(Head& head) {
    auto g = head.PullGradient(v1::DTYPE_FP32, false);
    EXPECT_TRUE(g.ok());
    return FromBytes<float>(g->data);
  }

  absl::StatusCode StepCode(Head& head, const MicroBatch& mb) {
    StepStats stats;
    return head.Step(mb, &stats).status().code();
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HeadRegistry> registry_;
};

TEST_F(HeadTest, CreateValidatesTheSpec) {
  auto code = [&](v1::HeadSpec spec) { return registry_->Create(spec).status().code(); };
  v1::HeadSpec s = Spec("ok");
  s.set_name("bad name!");
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec(std::string(129, 'a'));
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("v0");
  s.set_vocab_size(0);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("d0");
  s.set_hidden_size(0);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("int", v1::DTYPE_INT32);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("std");
  s.mutable_init()->mutable_normal()->set_std(0);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("ls");
  s.mutable_default_options()->set_label_smoothing(1.0f);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("cap");
  s.mutable_default_options()->set_logit_softcap(1e-40f);  // subnormal: 1 / cap is Inf
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  // A std whose draws overflow fp16 (largest finite 65504) would make a head of Inf weights.
  s = Spec("fp16_overflow", v1::DTYPE_FP16);
  s.mutable_init()->mutable_normal()->set_std(1e5f);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("huge");
  s.set_vocab_size(1 << 30);
  s.set_hidden_size(int64_t{1} << 40);
  EXPECT_EQ(code(s), absl::StatusCode::kResourceExhausted);
  // A faster matmul precision is for fp32 heads; no head takes a value outside the enum.
  s = Spec("tf32_bf16", v1::DTYPE_BF16);
  s.set_matmul_precision(v1::MATMUL_PRECISION_HIGH);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("bf16x_fp16", v1::DTYPE_FP16);
  s.set_matmul_precision(v1::MATMUL_PRECISION_MEDIUM);
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  s = Spec("precision9");
  s.set_matmul_precision(static_cast<v1::MatmulPrecision>(9));
  EXPECT_EQ(code(s), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->size(), 0u);

  // The same std is fine in fp32, a large one in fp16, and the smallest normal soft-cap.
  s = Spec("fp32_wide");
  s.mutable_init()->mutable_normal()->set_std(1e5f);
  EXPECT_TRUE(registry_->Create(s).ok());
  s = Spec("fp16_wide", v1::DTYPE_FP16);
  s.mutable_init()->mutable_normal()->set_std(1000.0f);
  s.mutable_default_options()->set_logit_softcap(std::numeric_limits<float>::min());
  EXPECT_TRUE(registry_->Create(s).ok());
  EXPECT_TRUE(registry_->Delete("fp32_wide").ok());
  EXPECT_TRUE(registry_->Delete("fp16_wide").ok());

  ASSERT_NE(Create("a.b-c_1"), nullptr);
  EXPECT_EQ(code(Spec("a.b-c_1")), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry_->Get("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_->Delete("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_->Delete("a.b-c_1").ok());
  EXPECT_EQ(registry_->Get("a.b-c_1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(HeadTest, NormalInitIsDeterministicAndInfoIsFresh) {
  auto a = Create("a");
  auto b = Create("b");
  EXPECT_EQ(Weights(*a), Weights(*b));
  v1::HeadInfo info = a->Info();
  EXPECT_EQ(info.weights_version(), 1u);
  EXPECT_EQ(info.memory().weights_bytes(), kV * kD * 4u);
  EXPECT_EQ(info.memory().gradient_bytes(), kV * kD * 4u);
  EXPECT_EQ(info.tokens_since_pull(), 0u);
  for (float g : Grad(*a)) EXPECT_EQ(g, 0.0f);
}

// HeadInfo names the precision a head computes at (HIGHEST where none was asked); on the CPU
// backend, which has no faster units, an fp32 head at HIGH or MEDIUM steps as HIGHEST, bit for bit.
TEST_F(HeadTest, MatmulPrecisionIsReportedAndCpuStepsAsHighest) {
  auto highest = Create("h");
  EXPECT_EQ(highest->Info().spec().matmul_precision(), v1::MATMUL_PRECISION_HIGHEST);
  v1::HeadSpec bf16 = Spec("bf16", v1::DTYPE_BF16);
  bf16.set_matmul_precision(v1::MATMUL_PRECISION_HIGHEST);
  auto bf16_head = registry_->Create(bf16);
  ASSERT_TRUE(bf16_head.ok()) << bf16_head.status();
  EXPECT_EQ((*bf16_head)->Info().spec().matmul_precision(), v1::MATMUL_PRECISION_HIGHEST);
  StepStats stats;
  auto want = highest->Step(Batch(5, 11), &stats);
  ASSERT_TRUE(want.ok()) << want.status();
  for (v1::MatmulPrecision precision : {v1::MATMUL_PRECISION_HIGH, v1::MATMUL_PRECISION_MEDIUM}) {
    SCOPED_TRACE(v1::MatmulPrecision_Name(precision));
    v1::HeadSpec spec = Spec(v1::MatmulPrecision_Name(precision));
    spec.set_matmul_precision(precision);
    auto head = registry_->Create(spec);
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ((*head)->Info().spec().matmul_precision(), precision);
    auto got = (*head)->Step(Batch(5, 11), &stats);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*got)->loss_sum, (*want)->loss_sum);
    EXPECT_EQ((*got)->grad_hidden, (*want)->grad_hidden);
    EXPECT_EQ(Grad(**head), Grad(*highest));
  }
}

TEST_F(HeadTest, StepMatchesTheReference) {
  auto head = Create("h");
  const std::vector<float> w = Weights(*head);
  MicroBatch mb = Batch(5, 7);
  auto y = FromBytes<int32_t>(mb.targets);
  y[2] = -100;  // ignored
  mb.targets = Bytes(y);
  StepStats stats;
  auto out = head->Step(mb, &stats);
  ASSERT_TRUE(out.ok()) << out.status();
  auto ref = testing::ReferenceMean(FromBytes<float>(mb.hidden), w, y, 5, kD, kV);
  EXPECT_EQ((*out)->token_count, 4);
  EXPECT_NEAR((*out)->loss_sum, ref.loss_sum, 1e-4);
  EXPECT_NEAR((*out)->loss, ref.loss_sum / 4, 1e-4);
  EXPECT_EQ((*out)->weights_version, 1u);
  EXPECT_EQ((*out)->grad_hidden_dtype, v1::DTYPE_FP32);
  auto dh = FromBytes<float>((*out)->grad_hidden);
  ASSERT_EQ(dh.size(), ref.grad_hidden.size());
  for (size_t i = 0; i < dh.size(); ++i) EXPECT_NEAR(dh[i], ref.grad_hidden[i], 1e-5);
  auto dw = Grad(*head);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], ref.grad_weight[i], 1e-5);
  v1::HeadInfo info = head->Info();
  EXPECT_EQ(info.tokens_since_pull(), 4u);
  EXPECT_EQ(info.microbatches_since_pull(), 1u);
}

// What the receiver hands over: hidden states in page-locked memory, checked for NaN and Inf as
// they arrived. The outcome is the one of the same bytes in ordinary memory.
TEST_F(HeadTest, AReceivedMicroBatchInPageLockedMemoryStepsLikeItsBytes) {
  auto plain = Create("plain");
  auto pinned = Create("pinned");
  auto pool = testing::HeapPinnedPool();
  const MicroBatch mb = Batch(7, 21);
  MicroBatch received = mb;
  PinnedBytes bytes = pool->Take(mb.hidden.size());
  ASSERT_TRUE(bytes.Append(mb.hidden));
  received.pinned_hidden = std::make_shared<PinnedBytes>(std::move(bytes));
  received.hidden.clear();
  received.hidden_max_abs = kernels::MaxAbs(kernels::DType::kFP32, mb.hidden.data(),
                                            mb.hidden.size() / sizeof(float));
  StepStats stats;
  auto want = plain->Step(mb, &stats);
  auto got = pinned->Step(received, &stats);
  ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
  EXPECT_EQ((*got)->loss_sum, (*want)->loss_sum);
  EXPECT_EQ((*got)->grad_hidden, (*want)->grad_hidden);
  EXPECT_EQ(Grad(*pinned), Grad(*plain));
  // A micro-batch the receiver found non-finite is refused without another pass, and counts
  // nothing.
  received.hidden_max_abs = std::numeric_limits<float>::infinity();
  auto refused = pinned->Step(received, &stats);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("NaN or Inf"), std::string::npos);
  EXPECT_EQ(pinned->Info().microbatches_since_pull(), 1u);
}

// The server hands every head one pool of dH buffers: a buffer one head's outcome gave back is
// the next result of another head, overwritten whole (its bytes are those of a head with a pool of
// its own).
TEST_F(HeadTest, HeadsShareTheServersDHBuffers) {
  auto results = std::make_shared<ResultPool>(size_t{8} << 20, /*min_bytes=*/1024);
  HeadRegistry shared(*backend_, HeadOptions{.results = results});
  auto a = shared.Create(Spec("a"));
  auto b = shared.Create(Spec("b"));
  auto own = Create("own");
  ASSERT_TRUE(a.ok() && b.ok() && own != nullptr);
  const MicroBatch first = Batch(64, 5);  // 64 x 6 fp32: 1,536 bytes of dH, over min_bytes
  const MicroBatch second = Batch(64, 9);
  StepStats stats;
  const void* buffer = nullptr;
  {
    auto out = (*a)->Step(first, &stats);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)->pool, results);
    buffer = (*out)->grad_hidden.data();
    EXPECT_EQ(results->idle_bytes(), 0u);
  }
  EXPECT_GE(results->idle_bytes(), first.hidden.size());
  auto got = (*b)->Step(second, &stats);
  auto want = own->Step(second, &stats);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_EQ((*got)->grad_hidden.data(), buffer);
  EXPECT_EQ(results->idle_bytes(), 0u);
  EXPECT_NE((*want)->pool, results);
  EXPECT_EQ((*got)->grad_hidden, (*want)->grad_hidden);
  EXPECT_EQ((*got)->loss_sum, (*want)->loss_sum);
}

TEST_F(HeadTest, Bf16HiddenOnFp32HeadAndGradDtype) {
  auto head = Create("h");
  MicroBatch mb = Batch(3, 1);
  std::vector<float> h = FromBytes<float>(mb.hidden);
  std::vector<uint16_t> hb(h.size());
  for (size_t i = 0; i < h.size(); ++i) hb[i] = kernels::FloatToBf16(h[i]);
  mb.hidden = Bytes(hb);
  mb.header.set_hidden_dtype(v1::DTYPE_BF16);
  StepStats stats;
  auto out = head->Step(mb, &stats);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)->grad_hidden_dtype, v1::DTYPE_BF16);
  EXPECT_EQ((*out)->grad_hidden.size(), 3u * kD * 2);

  mb.header.mutable_options()->set_grad_hidden_dtype(v1::DTYPE_FP32);
  mb.header.mutable_options()->set_return_per_token_loss(true);
  out = head->Step(mb, &stats);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)->grad_hidden.size(), 3u * kD * 4);
  EXPECT_EQ((*out)->per_token_loss.size(), 3u * 4);

  mb.header.mutable_options()->set_skip_grad_hidden(true);
  out = head->Step(mb, &stats);
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE((*out)->grad_hidden.empty());
}

TEST_F(HeadTest, InvalidMicroBatchesChangeNothing) {
  auto head = Create("h");
  auto check = [&](const MicroBatch& mb, absl::StatusCode want) {
    EXPECT_EQ(StepCode(*head, mb), want) << mb.header.DebugString();
  };
  MicroBatch mb = Batch(4, 3);
  mb.header.set_num_tokens(0);
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.hidden.pop_back();
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.targets += "xxxx";
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.header.set_hidden_dtype(v1::DTYPE_INT32);
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.header.set_target_dtype(v1::DTYPE_FP32);
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.header.mutable_options()->set_grad_hidden_dtype(v1::DTYPE_INT64);
  check(mb, absl::StatusCode::kInvalidArgument);
  mb = Batch(4, 3);
  mb.header.mutable_loss_options()->set_z_loss(-1);
  check(mb, absl::StatusCode::kInvalidArgument);
  for (int32_t bad : {static_cast<int32_t>(kV), -1}) {
    mb = Batch(4, 3);
    auto y = FromBytes<int32_t>(mb.targets);
    y[1] = bad;
    mb.targets = Bytes(y);
    check(mb, absl::StatusCode::kInvalidArgument);
  }
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    mb = Batch(4, 3);
    auto h = FromBytes<float>(mb.hidden);
    h[5] = bad;
    mb.hidden = Bytes(h);
    check(mb, absl::StatusCode::kInvalidArgument);
  }
  mb = Batch(4, 3);
  mb.header.mutable_options()->set_expected_weights_version(2);
  check(mb, absl::StatusCode::kFailedPrecondition);

  v1::HeadInfo info = head->Info();
  EXPECT_EQ(info.microbatches_total(), 0u);
  EXPECT_EQ(info.tokens_total(), 0u);
  for (float g : Grad(*head)) EXPECT_EQ(g, 0.0f);
}

TEST_F(HeadTest, Int64TargetsAndCustomIgnoreIndex) {
  auto head = Create("h");
  MicroBatch mb = Batch(3, 5);
  std::vector<int64_t> y = {1, int64_t{1} << 40, 2};
  mb.targets = Bytes(y);
  mb.header.set_target_dtype(v1::DTYPE_INT64);
  mb.header.mutable_loss_options()->set_ignore_index(int64_t{1} << 40);
  StepStats stats;
  auto out = head->Step(mb, &stats);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)->token_count, 2);
}

TEST_F(HeadTest, ReplayReturnsTheSameResultWithoutCountingTwice) {
  auto head = Create("h");
  MicroBatch mb = Batch(4, 9, "trainer-0", 1);
  StepStats first_stats;
  auto first = head->Step(mb, &first_stats);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first_stats.replayed);
  const std::vector<float> dw = Grad(*head);

  StepStats again_stats;
  auto again = head->Step(mb, &again_stats);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again_stats.replayed);
  EXPECT_EQ((*again)->loss, (*first)->loss);
  EXPECT_EQ((*again)->grad_hidden, (*first)->grad_hidden);
  EXPECT_EQ(Grad(*head), dw);
  EXPECT_EQ(head->Info().microbatches_total(), 1u);

  // Window of 2: after sequences 2 and 3, sequence 1 is out of the window.
  for (uint64_t s : {2, 3}) {
    StepStats st;
    ASSERT_TRUE(head->Step(Batch(4, 9 + s, "trainer-0", s), &st).ok());
  }
  EXPECT_EQ(StepCode(*head, mb), absl::StatusCode::kFailedPrecondition);
  // Failed micro-batches are not remembered: a corrected retry computes.
  MicroBatch bad = Batch(4, 20, "trainer-0", 4);
  bad.header.set_num_tokens(5);
  EXPECT_EQ(StepCode(*head, bad), absl::StatusCode::kInvalidArgument);
  StepStats st;
  ASSERT_TRUE(head->Step(Batch(4, 20, "trainer-0", 4), &st).ok());
  EXPECT_FALSE(st.replayed);
  EXPECT_EQ(head->Info().microbatches_total(), 4u);
}

TEST_F(HeadTest, PullResetCutsBetweenMicroBatches) {
  auto head = Create("h");
  StepStats st;
  ASSERT_TRUE(head->Step(Batch(4, 1), &st).ok());
  ASSERT_TRUE(head->Step(Batch(3, 2), &st).ok());
  auto pull = head->PullGradient(v1::DTYPE_FP32, true);
  ASSERT_TRUE(pull.ok());
  EXPECT_EQ(pull->summary.token_count(), 7u);
  EXPECT_EQ(pull->summary.microbatch_count(), 2u);
  EXPECT_EQ(pull->summary.min_weights_version(), 1u);
  EXPECT_EQ(pull->summary.max_weights_version(), 1u);
  EXPECT_TRUE(pull->summary.was_reset());
  EXPECT_EQ(pull->summary.total_bytes(), kV * kD * 4u);
  auto empty = head->PullGradient(v1::DTYPE_BF16, true);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->summary.token_count(), 0u);
  EXPECT_EQ(empty->summary.min_weights_version(), 0u);
  EXPECT_EQ(empty->data, std::string(kV * kD * 2, '\0'));
  EXPECT_EQ(head->PullGradient(v1::DTYPE_FP16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(HeadTest, ConcurrentPullsWithResetLoseNothing) {
  auto head = Create("h");
  constexpr int kBatches = 40;
  std::thread stepper([&] {
    for (int i = 0; i < kBatches; ++i) {
      StepStats st;
      ASSERT_TRUE(head->Step(Batch(2, i), &st).ok());
    }
  });
  uint64_t tokens = 0, batches = 0;
  for (int i = 0; i < 20; ++i) {
    auto pull = head->PullGradient(v1::DTYPE_FP32, true);
    ASSERT_TRUE(pull.ok());
    tokens += pull->summary.token_count();
    batches += pull->summary.microbatch_count();
  }
  stepper.join();
  auto last = head->PullGradient(v1::DTYPE_FP32, true);
  tokens += last->summary.token_count();
  batches += last->summary.microbatch_count();
  EXPECT_EQ(batches, static_cast<uint64_t>(kBatches));
  EXPECT_EQ(tokens, 2u * kBatches);
}

TEST_F(HeadTest, PushValidatesAndBumpsTheVersion) {
  auto head = Create("h");
  std::vector<float> w = RandomFloats(kV * kD, 3);
  EXPECT_EQ(head->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(w).substr(4), {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->PushWeights(v1::DTYPE_INT32, v1::PUSH_MODE_REPLACE, Bytes(w), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> nan = w;
  nan[3] = std::nanf("");
  EXPECT_EQ(
      head->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(nan), {}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(w), 5).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(head->weights_version(), 1u);

  auto v = head->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(w), 1);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 2u);
  EXPECT_EQ(Weights(*head), w);
  v = head->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_ADD, Bytes(w), {});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 3u);
  auto doubled = Weights(*head);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(doubled[i], 2 * w[i]);

  MicroBatch mb = Batch(2, 1);
  mb.header.mutable_options()->set_expected_weights_version(3);
  StepStats st;
  auto out = head->Step(mb, &st);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)->weights_version, 3u);
}

TEST_F(HeadTest, Bf16HeadDownloadsInAnyDtype) {
  auto head = Create("h", v1::DTYPE_BF16);
  auto bf = head->DownloadWeights(v1::DTYPE_UNSPECIFIED);
  ASSERT_TRUE(bf.ok());
  EXPECT_EQ(bf->dtype, v1::DTYPE_BF16);
  EXPECT_EQ(bf->data.size(), kV * kD * 2u);
  auto f32 = head->DownloadWeights(v1::DTYPE_FP32);
  ASSERT_TRUE(f32.ok());
  auto bits = FromBytes<uint16_t>(bf->data);
  auto floats = FromBytes<float>(f32->data);
  for (size_t i = 0; i < bits.size(); ++i) EXPECT_EQ(kernels::Bf16ToFloat(bits[i]), floats[i]);
  StepStats st;
  EXPECT_TRUE(head->Step(Batch(3, 4), &st).ok());
}

TEST_F(HeadTest, DeletedHeadFinishesItsWork) {
  auto head = Create("h");
  ASSERT_TRUE(registry_->Delete("h").ok());
  StepStats st;
  EXPECT_TRUE(head->Step(Batch(2, 1), &st).ok());  // still held: safe
}

}  // namespace
}  // namespace losshead::server
