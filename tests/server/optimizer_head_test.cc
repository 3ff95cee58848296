// The server-side optimizer at the engine: admission at create, the master copy's life beside W,
// and the request checks the client would otherwise make first.
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::RandomFloats;

std::unique_ptr<kernels::Backend> Cpu() {
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return std::move(*backend);
}

v1::HeadSpec Spec(const std::string& name, int64_t v, int64_t d, v1::DType dtype,
                  v1::OptimizerKind kind) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_optimizer()->set_kind(kind);
  return spec;
}

MicroBatch Batch(int64_t n, int64_t d, int64_t v, uint64_t seq) {
  std::vector<float> h = RandomFloats(static_cast<size_t>(n * d), seq + 1);
  std::vector<int32_t> y(n);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<int32_t>((i * 7 + seq) % v);
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id("c");
  mb.header.set_sequence(seq);
  mb.header.set_num_tokens(n);
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden = Bytes(h);
  mb.targets = Bytes(y);
  return mb;
}

v1::ApplyOptimizerRequest Apply(uint64_t key, double lr) {
  v1::ApplyOptimizerRequest r;
  r.set_client_id("c");
  r.set_step_key(key);
  r.mutable_params()->set_lr(lr);
  r.mutable_params()->set_beta1(0.9);
  r.mutable_params()->set_beta2(0.999);
  r.mutable_params()->set_eps(1e-8);
  return r;
}

TEST(OptimizerHeadTest, AdmissionRefusesAHeadWhoseOptimizerDoesNotFit) {
  auto backend = Cpu();
  const uint64_t free = backend->memory_info().free_bytes;
  ASSERT_GT(free, 0u);
  // W + dW (8 bytes per fp32 weight) take two thirds of what is free; AdamW's two moments
  // would double that.
  const int64_t d = int64_t{1} << 16;
  const int64_t v = std::max<int64_t>(1, static_cast<int64_t>(free / 12 / d));
  HeadRegistry registry(*backend, HeadOptions{});
  auto head = registry.Create(Spec("big", v, d, v1::DTYPE_FP32, v1::OPTIMIZER_ADAMW));
  EXPECT_EQ(head.status().code(), absl::StatusCode::kResourceExhausted) << head.status();
  EXPECT_EQ(registry.size(), 0u);
}

TEST(OptimizerHeadTest, MaxHeadBytesCountsTheOptimizer) {
  auto backend = Cpu();
  // fp32 W + dW of 64 x 8 fit exactly; AdamW's moments do not.
  HeadRegistry registry(*backend, HeadOptions{}, HeadLimits{.max_head_bytes = 64 * 8 * 8});
  ASSERT_TRUE(registry.Create(Spec("plain", 64, 8, v1::DTYPE_FP32, v1::OPTIMIZER_NONE)).ok());
  EXPECT_EQ(
      registry.Create(Spec("adamw", 64, 8, v1::DTYPE_FP32, v1::OPTIMIZER_ADAMW)).status().code(),
      absl::StatusCode::kInvalidArgument);
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  EXPECT_EQ(registry.SetOptimizer("plain", adamw).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*registry.Get("plain"))->Info().spec().optimizer().kind(), v1::OPTIMIZER_NONE);
}

TEST(OptimizerHeadTest, MasterFollowsPushesAndWIsItsRoundedImage) {
  auto backend = Cpu();
  constexpr int64_t kV = 21, kD = 10;
  auto head =
      Head::Create(*backend, Spec("h", kV, kD, v1::DTYPE_BF16, v1::OPTIMIZER_ADAMW), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  StepStats stats;
  ASSERT_TRUE((*head)->Step(Batch(12, kD, kV, 1), &stats).ok());
  auto applied = (*head)->ApplyOptimizer(Apply(1, 0.05));
  ASSERT_TRUE(applied.ok()) << applied.status();
  // A push replaces W; with lr 0 the next apply must keep exactly what was pushed (a master copy
  // left from before the push would put the old weights back).
  const std::vector<float> pushed = RandomFloats(kV * kD, 99);
  auto version =
      (*head)->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), std::nullopt);
  ASSERT_TRUE(version.ok()) << version.status();
  ASSERT_TRUE((*head)->Step(Batch(12, kD, kV, 2), &stats).ok());
  applied = (*head)->ApplyOptimizer(Apply(2, 0.0));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->weights_version(), *version + 1);
  auto w = (*head)->DownloadWeights(v1::DTYPE_BF16);
  ASSERT_TRUE(w.ok());
  std::string want(pushed.size() * 2, '\0');
  kernels::FromFloat(kernels::DType::kBF16, pushed.data(), want.data(), pushed.size());
  EXPECT_EQ(w->data, want);
  // A real step moves W by less than one bf16 ulp in places: the master keeps what W cannot.
  for (uint64_t key = 3; key < 6; ++key) {
    ASSERT_TRUE((*head)->Step(Batch(12, kD, kV, key), &stats).ok());
    ASSERT_TRUE((*head)->ApplyOptimizer(Apply(key, 1e-4)).ok());
  }
  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok());
  ASSERT_EQ(snap->master.size(), kV * kD * sizeof(float));
  std::string rounded(kV * kD * 2, '\0');
  kernels::FromFloat(kernels::DType::kBF16, reinterpret_cast<const float*>(snap->master.data()),
                     rounded.data(), kV * kD);
  EXPECT_EQ(snap->weights, rounded);
  EXPECT_EQ((*head)->Info().optimizer_step(), 5u);
}

TEST(OptimizerHeadTest, ServerChecksTheKeyItself) {
  auto backend = Cpu();
  auto head =
      Head::Create(*backend, Spec("h", 5, 4, v1::DTYPE_FP32, v1::OPTIMIZER_LION), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  v1::ApplyOptimizerRequest r = Apply(0, 0.1);
  r.set_grad_divisor(1);
  EXPECT_EQ((*head)->ApplyOptimizer(r).status().code(), absl::StatusCode::kInvalidArgument);
  r = Apply(1, 0.1);
  r.set_grad_divisor(1);
  r.clear_client_id();
  EXPECT_EQ((*head)->ApplyOptimizer(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.set_client_id("c");
  r.mutable_params()->set_beta2(1.5);  // Lion: [0, 1]
  EXPECT_EQ((*head)->ApplyOptimizer(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.mutable_params()->set_beta2(1.0);
  EXPECT_TRUE((*head)->ApplyOptimizer(r).ok());
}

}  // namespace
}  // namespace losshead::server
