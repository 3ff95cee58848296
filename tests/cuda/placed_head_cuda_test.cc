// A head replicated over 2 and 4 GPUs, and sharded by vocabulary rows over 1, 2 and 4 (each size
// skips where fewer are visible), against the same head on the CPU backend and on one GPU. A
// replicated head's micro-batches give the one-GPU head's loss and dH bit for bit (each runs
// whole on a replica holding the same W); a sharded head's agree up to summation order (the
// shards combine their softmax statistics and dH parts). dW after pulls and W after AdamW steps
// are within bf16 rounding of the CPU backend's, and a rerun of the same sequence is
// bit-identical (micro-batches sent one at a time go round the replicas in the same order, the
// shards' kernels are deterministic, and NCCL gives the same bits for the same call). The same
// placements over 2 and 3 ranks of device 0 (the staged collective instead of NCCL) run wherever
// one GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/cuda/placed_devices.h"
#include "tests/server/bf16_microbatch.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 1031, kD = 256;  // 1031 rows: uneven row shards on 2 and 4 devices
constexpr int kMicrobatches = 8;

v1::HeadSpec Spec(int devices, v1::PlacementKind kind = v1::PLACEMENT_SINGLE,
                  v1::DType dtype = v1::DTYPE_BF16,
                  v1::MatmulPrecision precision = v1::MATMUL_PRECISION_UNSPECIFIED) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(dtype);
  spec.set_matmul_precision(precision);
  spec.mutable_init()->mutable_normal()->set_std(0.05f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.mutable_placement()->set_kind(kind);
  spec.mutable_placement()->set_devices(devices);
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
  return Bf16MicroBatch("h", "c", i + 1, h, y);
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

// Each micro-batch's loss and dH of `got` against the CPU backend's run: bf16 inputs and outputs,
// fp32 accumulation in another order.
void ExpectMicroBatchesNearCpu(const SequenceResult& got, const SequenceResult& cpu_run) {
  ASSERT_EQ(got.dh.size(), cpu_run.dh.size());
  for (size_t i = 0; i < got.dh.size(); ++i) {
    EXPECT_NEAR(got.losses[i], cpu_run.losses[i], 2e-3 * std::abs(cpu_run.losses[i]))
        << "micro-batch " << i;
    EXPECT_LT(RelativeError(Floats(got.dh[i], kernels::DType::kBF16),
                            Floats(cpu_run.dh[i], kernels::DType::kBF16)),
              2e-2)
        << "micro-batch " << i;
  }
}

struct Placed {
  v1::PlacementKind kind;
  int k;
  // k backends on device 0, joined by the staged collective rather than NCCL: the placement's
  // own logic (row shards, statistics, replicas, reductions) on a machine with one GPU.
  bool one_gpu = false;
  // Deferred dW on every GPU head of the case (the CPU head adds as it runs): a 1 MiB stash per
  // device, a few hundred tokens, so that it fills and flushes within a window and the largest
  // micro-batches add to dW directly; no idle flush, so that reruns keep their bits.
  bool deferred = false;
};

// The case's devices (skipped where too few GPUs are visible), a CPU backend for the reference
// head, and the GPU heads' options.
class PlacedHeadsTest : public ::testing::TestWithParam<Placed> {
 protected:
  void SetUp() override {
    const int k = GetParam().k;
    if (const std::string why = testing::TooFewGpus(k, GetParam().one_gpu); !why.empty()) {
      GTEST_SKIP() << why;
    }
    auto gpus = testing::PlacedBackends(k, GetParam().one_gpu);
    ASSERT_TRUE(gpus.ok()) << gpus.status();
    gpus_ = *std::move(gpus);
    devices_ = testing::Pointers(gpus_);
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
    options_.grad_stash_bytes = GetParam().deferred ? size_t{1} << 20 : 0;
  }

  std::vector<std::unique_ptr<kernels::Backend>> gpus_;
  std::vector<kernels::Backend*> devices_;
  std::unique_ptr<kernels::Backend> cpu_;
  HeadOptions options_;
};

class PlacedCudaTest : public PlacedHeadsTest {};

TEST_P(PlacedCudaTest, MatchesOneGpuAndTheCpuBackendAndRerunsBitForBit) {
  const int k = GetParam().k;
  const bool sharded = GetParam().kind == v1::PLACEMENT_SHARDED;
  const std::vector<kernels::Backend*>& devices = devices_;
  const HeadOptions& options = options_;
  auto on_cpu = Head::Create(*cpu_, Spec(1), HeadOptions{});
  auto on_one = Head::Create(*devices[0], Spec(1), options);
  auto replicated = Head::Create(devices, Spec(k, GetParam().kind), options);
  auto again = Head::Create(devices, Spec(k, GetParam().kind), options);
  ASSERT_TRUE(on_cpu.ok() && on_one.ok() && replicated.ok() && again.ok())
      << on_cpu.status() << on_one.status() << replicated.status() << again.status();
  ASSERT_EQ((*replicated)->Info().devices_size(), k);

  const SequenceResult cpu_run = RunSequence(**on_cpu);
  const SequenceResult one = RunSequence(**on_one);
  const SequenceResult first = RunSequence(**replicated);
  const SequenceResult second = RunSequence(**again);
  ASSERT_EQ(first.dh.size(), one.dh.size());

  // The first window's micro-batches all ran on one W: each bit for bit the one-GPU head's when
  // replicated, up to the order of the sums when sharded.
  for (int i = 0; i < kMicrobatches; ++i) {
    if (sharded) {
      // Both round the logits to bf16 (CudaBackendOptions::bf16_logits); the shards combine
      // their statistics in another order, and so round G and dH a little differently.
      EXPECT_NEAR(first.losses[i], one.losses[i], 1e-3 * std::abs(one.losses[i]))
          << "micro-batch " << i;
      EXPECT_LT(RelativeError(Floats(first.dh[i], kernels::DType::kBF16),
                              Floats(one.dh[i], kernels::DType::kBF16)),
                1e-2)
          << "micro-batch " << i;
    } else {
      EXPECT_EQ(first.losses[i], one.losses[i]) << "micro-batch " << i;
      EXPECT_EQ(first.dh[i], one.dh[i]) << "micro-batch " << i;
    }
  }
  ExpectMicroBatchesNearCpu(first, cpu_run);
  EXPECT_LT(RelativeError(Floats(first.dw, kernels::DType::kFP32),
                          Floats(cpu_run.dw, kernels::DType::kFP32)),
            1e-2);
  EXPECT_LT(RelativeError(Floats(first.w, kernels::DType::kBF16),
                          Floats(cpu_run.w, kernels::DType::kBF16)),
            1e-2);
  EXPECT_LT(RelativeError(Floats(first.last_dw, kernels::DType::kFP32),
                          Floats(cpu_run.last_dw, kernels::DType::kFP32)),
            2e-2);
  // The window is the one-GPU window up to the order of its fp32 sums (and, sharded, to the
  // rounding of the gradient operand, which the shards compute from their own statistics).
  EXPECT_LT(
      RelativeError(Floats(first.dw, kernels::DType::kFP32), Floats(one.dw, kernels::DType::kFP32)),
      sharded ? 1e-2 : 1e-5);

  // A rerun: the same bits everywhere.
  EXPECT_EQ(first.losses, second.losses);
  EXPECT_TRUE(first.dh == second.dh);
  EXPECT_TRUE(first.dw == second.dw);
  EXPECT_TRUE(first.w == second.w);
  EXPECT_TRUE(first.last_dw == second.last_dw);

  // Each device holds W (a shard: its rows of it), its dW and a k-th of the optimizer state.
  const v1::HeadInfo info = (*replicated)->Info();
  EXPECT_EQ(info.spec().placement().kind(), GetParam().kind);
  uint64_t state = 0;
  for (int r = 0; r < info.device_memory_size(); ++r) {
    const v1::HeadMemory& memory = info.device_memory(r);
    const uint64_t rows = sharded ? kernels::ShardRange(kV, k, r).size() : kV;
    EXPECT_EQ(memory.weights_bytes(), rows * kD * 2);
    EXPECT_EQ(memory.gradient_bytes(), rows * kD * 4);
    EXPECT_LT(memory.optimizer_state_bytes(), static_cast<uint64_t>(kV * kD * 8) / k + kD * 8);
    state += memory.optimizer_state_bytes();
  }
  EXPECT_EQ(state, static_cast<uint64_t>(kV * kD * 8));
}

INSTANTIATE_TEST_SUITE_P(
    Gpus, PlacedCudaTest,
    ::testing::Values(Placed{v1::PLACEMENT_REPLICATED, 2}, Placed{v1::PLACEMENT_REPLICATED, 4},
                      Placed{v1::PLACEMENT_SHARDED, 1}, Placed{v1::PLACEMENT_SHARDED, 2},
                      Placed{v1::PLACEMENT_SHARDED, 4}, Placed{v1::PLACEMENT_REPLICATED, 2, true},
                      Placed{v1::PLACEMENT_REPLICATED, 3, true},
                      Placed{v1::PLACEMENT_SHARDED, 2, true},
                      Placed{v1::PLACEMENT_SHARDED, 3, true},
                      Placed{v1::PLACEMENT_SHARDED, 2, false, true},
                      Placed{v1::PLACEMENT_SHARDED, 4, false, true},
                      Placed{v1::PLACEMENT_REPLICATED, 4, false, true},
                      Placed{v1::PLACEMENT_REPLICATED, 2, true, true},
                      Placed{v1::PLACEMENT_SHARDED, 3, true, true}),
    [](const auto& info) {
      return absl::StrCat(info.param.kind == v1::PLACEMENT_SHARDED ? "sharded_" : "replicated_",
                          info.param.k, info.param.one_gpu ? "ranks_on_one_gpu" : "gpus",
                          info.param.deferred ? "_deferred" : "");
    });

// An fp32 head at MATMUL_PRECISION_HIGH, placed: every GEMM (a replica's, a shard's, a stash's
// flush) runs on the TF32 tensor cores. Its losses, dH, dW and W after AdamW stay within the
// bounds the bf16 head meets against the CPU backend (which computes as HIGHEST), its dW moves away
// from the same head's at HIGHEST by TF32's rounding, and a rerun gives the same bits.
class PlacedFp32HighCudaTest : public PlacedHeadsTest {};

TEST_P(PlacedFp32HighCudaTest, RunsOnTf32AndMatchesTheCpuBackend) {
  const int k = GetParam().k;
  const auto spec = [&](int devices, v1::PlacementKind kind, v1::MatmulPrecision precision) {
    return Spec(devices, kind, v1::DTYPE_FP32, precision);
  };
  auto on_cpu =
      Head::Create(*cpu_, spec(1, v1::PLACEMENT_SINGLE, v1::MATMUL_PRECISION_HIGH), HeadOptions{});
  auto high = Head::Create(devices_, spec(k, GetParam().kind, v1::MATMUL_PRECISION_HIGH), options_);
  auto again =
      Head::Create(devices_, spec(k, GetParam().kind, v1::MATMUL_PRECISION_HIGH), options_);
  auto highest =
      Head::Create(devices_, spec(k, GetParam().kind, v1::MATMUL_PRECISION_HIGHEST), options_);
  ASSERT_TRUE(on_cpu.ok() && high.ok() && again.ok() && highest.ok())
      << on_cpu.status() << high.status() << again.status() << highest.status();
  EXPECT_EQ((*high)->Info().spec().matmul_precision(), v1::MATMUL_PRECISION_HIGH);

  const SequenceResult cpu_run = RunSequence(**on_cpu);
  const SequenceResult first = RunSequence(**high);
  const SequenceResult second = RunSequence(**again);
  const SequenceResult ieee = RunSequence(**highest);
  ExpectMicroBatchesNearCpu(first, cpu_run);
  const auto fp32 = [](const std::string& bytes) { return Floats(bytes, kernels::DType::kFP32); };
  EXPECT_LT(RelativeError(fp32(first.dw), fp32(cpu_run.dw)), 1e-2);
  EXPECT_LT(RelativeError(Floats(first.w, kernels::DType::kBF16),
                          Floats(cpu_run.w, kernels::DType::kBF16)),
            1e-2);
  EXPECT_LT(RelativeError(fp32(first.last_dw), fp32(cpu_run.last_dw)), 2e-2);
  // IEEE fp32 on the same devices differs from TF32 by far more than its own summation order.
  EXPECT_GT(RelativeError(fp32(first.dw), fp32(ieee.dw)), 1e-5);
  EXPECT_LT(RelativeError(fp32(ieee.dw), fp32(cpu_run.dw)), 1e-4);

  EXPECT_EQ(first.losses, second.losses);
  EXPECT_TRUE(first.dh == second.dh);
  EXPECT_TRUE(first.dw == second.dw);
  EXPECT_TRUE(first.w == second.w);
  EXPECT_TRUE(first.last_dw == second.last_dw);
}

INSTANTIATE_TEST_SUITE_P(Gpus, PlacedFp32HighCudaTest,
                         ::testing::Values(Placed{v1::PLACEMENT_REPLICATED, 2, false, true},
                                           Placed{v1::PLACEMENT_SHARDED, 2, false, true},
                                           Placed{v1::PLACEMENT_REPLICATED, 2, true, true},
                                           Placed{v1::PLACEMENT_SHARDED, 3, true, true}),
                         [](const auto& info) {
                           return absl::StrCat(
                               info.param.kind == v1::PLACEMENT_SHARDED ? "sharded_"
                                                                        : "replicated_",
                               info.param.k, info.param.one_gpu ? "ranks_on_one_gpu" : "gpus");
                         });

// A micro-batch that could overflow is refused (OUT_OF_RANGE) before it runs on the GPUs, whatever
// the placement and with deferred dW on: the window holds the honest micro-batches alone (against
// the CPU backend's head given the same ones) and the optimizer steps over it.
class PlacedOverflowCudaTest : public PlacedHeadsTest {};

TEST_P(PlacedOverflowCudaTest, InputsThatWouldOverflowAreRefusedAndTheWindowStaysExact) {
  auto gpu = Head::Create(devices_, Spec(GetParam().k, GetParam().kind), options_);
  auto cpu = Head::Create(*cpu_, Spec(1), HeadOptions{});
  ASSERT_TRUE(gpu.ok() && cpu.ok()) << gpu.status() << cpu.status();
  auto step = [](Head& head, const MicroBatch& mb) {
    StepStats stats;
    return head.Step(mb, &stats).status();
  };
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(step(**gpu, Batch(i)).ok());
    ASSERT_TRUE(step(**cpu, Batch(i)).ok());
  }
  MicroBatch huge = Batch(10);
  std::vector<float> h(huge.header.num_tokens() * kD);
  kernels::ToFloat(kernels::DType::kBF16, huge.hidden.data(), h.data(), h.size());
  for (int64_t k = 0; k < kD; ++k) h[5 * kD + k] = 3e38f;
  kernels::FromFloat(kernels::DType::kBF16, h.data(), huge.hidden.data(), h.size());
  EXPECT_EQ(step(**gpu, huge).code(), absl::StatusCode::kOutOfRange);
  MicroBatch zloss = Batch(11);
  zloss.header.mutable_loss_options()->set_z_loss(3e37f);
  EXPECT_EQ(step(**gpu, zloss).code(), absl::StatusCode::kOutOfRange);
  MicroBatch scaled = Batch(12);
  scaled.header.mutable_options()->set_grad_scale(3e38f);
  scaled.header.mutable_options()->set_reduction(v1::REDUCTION_SUM);
  EXPECT_EQ(step(**gpu, scaled).code(), absl::StatusCode::kOutOfRange);

  auto got = (*gpu)->PullGradient(v1::DTYPE_FP32, /*reset=*/false);
  auto want = (*cpu)->PullGradient(v1::DTYPE_FP32, /*reset=*/false);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_EQ(got->summary.microbatch_count(), 3u);
  EXPECT_EQ(got->summary.token_count(), want->summary.token_count());
  EXPECT_LT(RelativeError(Floats(got->data, kernels::DType::kFP32),
                          Floats(want->data, kernels::DType::kFP32)),
            1e-2);
  v1::ApplyOptimizerRequest apply;
  apply.set_client_id("c");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(1e-2);
  apply.mutable_params()->set_beta1(0.9);
  apply.mutable_params()->set_beta2(0.95);
  apply.mutable_params()->set_eps(1e-8);
  auto applied = (*gpu)->ApplyOptimizer(apply);
  EXPECT_TRUE(applied.ok()) << applied.status();
  // After the apply W's bound is the optimizer's: an honest micro-batch still counts.
  EXPECT_TRUE(step(**gpu, Batch(13)).ok());
}

INSTANTIATE_TEST_SUITE_P(Gpus, PlacedOverflowCudaTest,
                         ::testing::Values(Placed{v1::PLACEMENT_REPLICATED, 2, false, true},
                                           Placed{v1::PLACEMENT_SHARDED, 2, false, true},
                                           Placed{v1::PLACEMENT_REPLICATED, 2, true, false},
                                           Placed{v1::PLACEMENT_SHARDED, 3, true, true},
                                           Placed{v1::PLACEMENT_SINGLE, 1, false, true}),
                         [](const auto& info) {
                           return absl::StrCat(
                               info.param.kind == v1::PLACEMENT_SHARDED      ? "sharded_"
                               : info.param.kind == v1::PLACEMENT_REPLICATED ? "replicated_"
                                                                             : "single_",
                               info.param.k, info.param.one_gpu ? "ranks_on_one_gpu" : "gpus",
                               info.param.deferred ? "_deferred" : "");
                         });

// The token outputs and the top-k of a placed head against the one-GPU head's on the same W: a
// replicated head's bit for bit (each micro-batch runs whole on one replica); a sharded head's
// combined from its shards' statistics, so equal up to summation order: the values within fp32
// rounding of the logits' scale, the ids equal except between values within that of each other
// (near-ties), the first id the argmax. Forward-only and counted micro-batches alike.
class PlacedOutputsCudaTest : public PlacedHeadsTest {};

TEST_P(PlacedOutputsCudaTest, MatchTheOneGpuHead) {
  const bool sharded = GetParam().kind == v1::PLACEMENT_SHARDED;
  constexpr int kTopK = 8;
  auto on_one = Head::Create(*devices_[0], Spec(1), options_);
  auto placed = Head::Create(devices_, Spec(GetParam().k, GetParam().kind), options_);
  ASSERT_TRUE(on_one.ok() && placed.ok()) << on_one.status() << placed.status();
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(absl::StrCat("micro-batch ", i));
    auto asked = [&] {
      MicroBatch mb = Batch(200 + i);
      v1::StepOptions& o = *mb.header.mutable_options();
      o.set_forward_only(i % 2 == 1);
      for (v1::TokenOutput t : {v1::TOKEN_OUTPUT_LOGPROB, v1::TOKEN_OUTPUT_ENTROPY,
                                v1::TOKEN_OUTPUT_LSE, v1::TOKEN_OUTPUT_ARGMAX}) {
        o.add_token_outputs(t);
      }
      o.set_return_correct_count(true);
      o.set_top_k(kTopK);
      return mb;
    };
    StepStats s1, s2;
    MicroBatch mb1 = asked();
    MicroBatch mb2 = asked();
    auto a = (*on_one)->Step(mb1, &s1);
    auto b = (*placed)->Step(mb2, &s2);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    const StepOutcome& x = **a;
    const StepOutcome& y = **b;
    const int64_t n = mb1.header.num_tokens();
    ASSERT_EQ(y.top_k_ids.size(), static_cast<size_t>(n * kTopK * 4));
    ASSERT_EQ(y.top_k_logprobs.size(), static_cast<size_t>(n * kTopK * 4));
    if (!sharded) {
      EXPECT_TRUE(x.token_outputs == y.token_outputs);
      EXPECT_EQ(x.top_k_ids, y.top_k_ids);
      EXPECT_EQ(x.top_k_logprobs, y.top_k_logprobs);
      EXPECT_EQ(x.correct_count, y.correct_count);
      continue;
    }
    auto floats = [](const std::string& bytes) {
      std::vector<float> out(bytes.size() / 4);
      std::memcpy(out.data(), bytes.data(), bytes.size());
      return out;
    };
    auto ints = [](const std::string& bytes) {
      std::vector<int32_t> out(bytes.size() / 4);
      std::memcpy(out.data(), bytes.data(), bytes.size());
      return out;
    };
    auto close = [](float p, float q) {
      return std::abs(p - q) <= 1e-4f * std::max(1.0f, std::abs(p));
    };
    for (TokenOutput t : {TokenOutput::kLogprob, TokenOutput::kEntropy, TokenOutput::kLse}) {
      const std::vector<float> p = floats(x.token_output(t)), q = floats(y.token_output(t));
      ASSERT_EQ(p.size(), q.size());
      for (size_t j = 0; j < p.size(); ++j) {
        EXPECT_TRUE(close(p[j], q[j])) << "output " << static_cast<int>(t) << " token " << j;
      }
    }
    const std::vector<int32_t> ids_x = ints(x.top_k_ids), ids_y = ints(y.top_k_ids);
    const std::vector<float> lp_x = floats(x.top_k_logprobs), lp_y = floats(y.top_k_logprobs);
    const std::vector<int32_t> argmax = ints(y.token_output(TokenOutput::kArgmax));
    for (int64_t t = 0; t < n; ++t) {
      EXPECT_EQ(ids_y[t * kTopK], argmax[t]) << "token " << t;
      for (int j = 0; j < kTopK; ++j) {
        const int64_t at = t * kTopK + j;
        EXPECT_TRUE(close(lp_x[at], lp_y[at])) << "token " << t << " place " << j;
        if (ids_x[at] == ids_y[at]) continue;
        // Only a near-tie may swap ids: a neighbour's value lies within rounding of this one.
        const bool tie = (j > 0 && close(lp_x[at], lp_x[at - 1])) ||
                         (j + 1 < kTopK && close(lp_x[at], lp_x[at + 1]));
        EXPECT_TRUE(tie) << "token " << t << " place " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Gpus, PlacedOutputsCudaTest,
    ::testing::Values(Placed{v1::PLACEMENT_REPLICATED, 2}, Placed{v1::PLACEMENT_SHARDED, 2},
                      Placed{v1::PLACEMENT_SHARDED, 4}, Placed{v1::PLACEMENT_SHARDED, 2, true},
                      Placed{v1::PLACEMENT_SHARDED, 3, true, true}),
    [](const auto& info) {
      return absl::StrCat(info.param.kind == v1::PLACEMENT_SHARDED ? "sharded_" : "replicated_",
                          info.param.k, info.param.one_gpu ? "ranks_on_one_gpu" : "gpus",
                          info.param.deferred ? "_deferred" : "");
    });

}  // namespace
}  // namespace losshead::server
