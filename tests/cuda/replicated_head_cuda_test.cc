// A head replicated over 2 and 4 GPUs (each size skips where fewer are visible) against the same
// head on the CPU backend and on one GPU: every micro-batch's loss and dH bit for bit those of the
// one-GPU head (each runs whole on a replica holding the same W), dW after pulls and W after
// AdamW steps within bf16 rounding of the CPU backend's, and a rerun of the same sequence
// bit-identical (micro-batches sent one at a time go round the replicas in the same order, and
// NCCL gives the same bits for the same call).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 1031, kD = 256;  // 1031 rows: uneven row shards on 2 and 4 devices
constexpr int kMicrobatches = 8;

v1::HeadSpec Spec(int replicas) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_init()->mutable_normal()->set_std(0.05f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  if (replicas > 1) {
    spec.mutable_placement()->set_kind(v1::PLACEMENT_REPLICATED);
    spec.mutable_placement()->set_devices(replicas);
  }
  return spec;
}

MicroBatch Batch(int i) {
  const int64_t n = 96 + 37 * i;  // sizes differ: chunking and token counts vary
  std::mt19937_64 rng(1000 + i);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(n * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(n);
  std::uniform_int_distribution<int32_t> pick(0, kV - 1);
  for (int64_t t = 0; t < n; ++t) y[t] = t % 7 == 3 ? -100 : pick(rng);
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id("c");
  mb.header.set_sequence(i + 1);
  mb.header.set_num_tokens(n);
  mb.header.set_hidden_dtype(v1::DTYPE_BF16);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden.resize(n * kD * 2);
  kernels::FromFloat(kernels::DType::kBF16, h.data(), mb.hidden.data(), n * kD);
  mb.targets.assign(reinterpret_cast<const char*>(y.data()), n * sizeof(int32_t));
  return mb;
}

// What one run of the sequence gives back: per micro-batch loss and dH, the window pulled
// before the step, W after two AdamW steps, and the last window.
struct SequenceResult {
  std::vector<double> losses;
  std::vector<std::string> dh;
  std::string dw;
  std::string w;
  std::string last_dw;
};

SequenceResult RunSequence(Head& head) {
  SequenceResult run;
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kMicrobatches; ++i) {
      MicroBatch mb = Batch(step * kMicrobatches + i);
      StepStats stats;
      auto outcome = head.Step(mb, &stats);
      EXPECT_TRUE(outcome.ok()) << outcome.status();
      if (!outcome.ok()) return run;
      run.losses.push_back((*outcome)->loss);
      run.dh.push_back((*outcome)->grad_hidden);
    }
    if (step == 0) {
      auto pulled = head.PullGradient(v1::DTYPE_FP32, /*reset=*/false);
      EXPECT_TRUE(pulled.ok()) << pulled.status();
      if (pulled.ok()) run.dw = pulled->data;
    }
    v1::ApplyOptimizerRequest apply;
    apply.set_client_id("c");
    apply.set_step_key(step + 1);
    apply.mutable_params()->set_lr(1e-2);
    apply.mutable_params()->set_beta1(0.9);
    apply.mutable_params()->set_beta2(0.95);
    apply.mutable_params()->set_eps(1e-8);
    apply.mutable_params()->set_weight_decay(0.1);
    apply.set_max_norm(1.0);
    auto applied = head.ApplyOptimizer(apply);
    EXPECT_TRUE(applied.ok()) << applied.status();
  }
  auto w = head.DownloadWeights(v1::DTYPE_BF16);
  EXPECT_TRUE(w.ok()) << w.status();
  if (w.ok()) run.w = w->data;
  for (int i = 0; i < 3; ++i) {
    MicroBatch mb = Batch(100 + i);
    StepStats stats;
    EXPECT_TRUE(head.Step(mb, &stats).ok());
  }
  auto last = head.PullGradient(v1::DTYPE_FP32, /*reset=*/true);
  EXPECT_TRUE(last.ok()) << last.status();
  if (last.ok()) run.last_dw = last->data;
  return run;
}

std::vector<float> Floats(const std::string& bytes, kernels::DType dtype) {
  const size_t count = bytes.size() / kernels::DTypeSize(dtype);
  std::vector<float> out(count);
  kernels::ToFloat(dtype, bytes.data(), out.data(), count);
  return out;
}

// ||got - want|| / ||want||.
double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

class ReplicatedCudaTest : public ::testing::TestWithParam<int> {};

TEST_P(ReplicatedCudaTest, MatchesOneGpuAndTheCpuBackendAndRerunsBitForBit) {
  const int k = GetParam();
  if (kernels::CudaDeviceCount() < k) {
    GTEST_SKIP() << "needs " << k << " CUDA devices, " << kernels::CudaDeviceCount() << " visible";
  }
  std::vector<std::unique_ptr<kernels::Backend>> gpus;
  std::vector<kernels::Backend*> devices;
  for (int i = 0; i < k; ++i) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCuda, i);
    ASSERT_TRUE(backend.ok()) << backend.status();
    devices.push_back(backend->get());
    gpus.push_back(std::move(*backend));
  }
  auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  auto on_cpu = Head::Create(**cpu, Spec(1), HeadOptions{});
  auto on_one = Head::Create(*devices[0], Spec(1), HeadOptions{});
  auto replicated = Head::Create(devices, Spec(k), HeadOptions{});
  auto again = Head::Create(devices, Spec(k), HeadOptions{});
  ASSERT_TRUE(on_cpu.ok() && on_one.ok() && replicated.ok() && again.ok())
      << on_cpu.status() << on_one.status() << replicated.status() << again.status();
  ASSERT_EQ((*replicated)->Info().devices_size(), k);

  const SequenceResult cpu_run = RunSequence(**on_cpu);
  const SequenceResult one = RunSequence(**on_one);
  const SequenceResult first = RunSequence(**replicated);
  const SequenceResult second = RunSequence(**again);
  ASSERT_EQ(first.dh.size(), one.dh.size());

  // The first window's micro-batches all ran on one W: each bit for bit the one-GPU head's.
  for (int i = 0; i < kMicrobatches; ++i) {
    EXPECT_EQ(first.losses[i], one.losses[i]) << "micro-batch " << i;
    EXPECT_EQ(first.dh[i], one.dh[i]) << "micro-batch " << i;
  }
  // Against the CPU backend: bf16 inputs and outputs, fp32 accumulation in another order.
  for (size_t i = 0; i < first.dh.size(); ++i) {
    EXPECT_NEAR(first.losses[i], cpu_run.losses[i], 2e-3 * std::abs(cpu_run.losses[i]));
    EXPECT_LT(RelativeError(Floats(first.dh[i], kernels::DType::kBF16),
                            Floats(cpu_run.dh[i], kernels::DType::kBF16)),
              2e-2)
        << "micro-batch " << i;
  }
  EXPECT_LT(RelativeError(Floats(first.dw, kernels::DType::kFP32),
                          Floats(cpu_run.dw, kernels::DType::kFP32)),
            1e-2);
  EXPECT_LT(RelativeError(Floats(first.w, kernels::DType::kBF16),
                          Floats(cpu_run.w, kernels::DType::kBF16)),
            1e-2);
  EXPECT_LT(RelativeError(Floats(first.last_dw, kernels::DType::kFP32),
                          Floats(cpu_run.last_dw, kernels::DType::kFP32)),
            2e-2);
  // The replicated window is the one-GPU window up to the order of its fp32 sums.
  EXPECT_LT(
      RelativeError(Floats(first.dw, kernels::DType::kFP32), Floats(one.dw, kernels::DType::kFP32)),
      1e-5);

  // A rerun: the same bits everywhere.
  EXPECT_EQ(first.losses, second.losses);
  EXPECT_TRUE(first.dh == second.dh);
  EXPECT_TRUE(first.dw == second.dw);
  EXPECT_TRUE(first.w == second.w);
  EXPECT_TRUE(first.last_dw == second.last_dw);

  // Each device holds W, its dW and a k-th of the optimizer state.
  const v1::HeadInfo info = (*replicated)->Info();
  uint64_t state = 0;
  for (const v1::HeadMemory& memory : info.device_memory()) {
    EXPECT_EQ(memory.weights_bytes(), static_cast<uint64_t>(kV * kD * 2));
    EXPECT_LT(memory.optimizer_state_bytes(), static_cast<uint64_t>(kV * kD * 8) / k + kD * 8);
    state += memory.optimizer_state_bytes();
  }
  EXPECT_EQ(state, static_cast<uint64_t>(kV * kD * 8));
}

INSTANTIATE_TEST_SUITE_P(Gpus, ReplicatedCudaTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "gpus"; });

}  // namespace
}  // namespace losshead::server
