// On a GPU, the deferred-dW stash gives way to a head that needs its memory: a head that fits the
// device only without another head's stash is created, the stash is added to dW first (the
// window equals that of the same micro-batches run without a stash, up to summation order), and
// the first head goes on adding to dW directly. tests/server/stash_memory_test.cc covers the
// rest on a CPU device with a memory limit.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"
#include "tests/cuda/tolerance.h"
#include "tests/server/bf16_microbatch.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 32000, kD = 1024;
constexpr size_t kStashBytes = size_t{1} << 30;
constexpr size_t kMiB = size_t{1} << 20;

v1::HeadSpec Spec(const std::string& name, int64_t vocab, v1::DType dtype) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(vocab);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(dtype);
  if (name == "a") {
    spec.mutable_init()->mutable_normal()->set_std(0.02f);
    spec.mutable_init()->mutable_normal()->set_seed(7);
  }
  return spec;
}

MicroBatch Batch(int i) {
  const int64_t n = 1024 + 256 * i;
  std::mt19937_64 rng(300 + i);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(n * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(n);
  std::uniform_int_distribution<int32_t> pick(0, kV - 1);
  for (int64_t t = 0; t < n; ++t) y[t] = t % 9 == 4 ? -100 : pick(rng);
  return Bf16MicroBatch("a", "c", i + 1, h, y);
}

std::vector<float> PullDw(Head& head) {
  auto g = head.PullGradient(v1::DTYPE_FP32, /*reset=*/false);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return {};
  std::vector<float> out(g->data.size() / sizeof(float));
  std::memcpy(out.data(), g->data.data(), g->data.size());
  return out;
}

void StepAll(Head& head, int first, int count) {
  for (int i = first; i < first + count; ++i) {
    MicroBatch mb = Batch(i);
    StepStats stats;
    auto outcome = head.Step(mb, &stats);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
  }
}

TEST(StashMemoryCudaTest, AHeadThatNeedsTheMemoryGetsTheStashAndNothingIsLost) {
  if (kernels::CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  auto gpu = kernels::CreateBackend(kernels::BackendKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  // The window of micro-batches 0-5 without a stash.
  std::vector<float> want;
  {
    auto direct = Head::Create(**gpu, Spec("a", kV, v1::DTYPE_BF16), HeadOptions{});
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_NO_FATAL_FAILURE(StepAll(**direct, 0, 6));
    want = PullDw(**direct);
  }

  HeadRegistry registry(**gpu, HeadOptions{.grad_stash_bytes = kStashBytes,
                                           .grad_stash_idle = absl::InfiniteDuration()});
  auto a = registry.Create(Spec("a", kV, v1::DTYPE_BF16));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_NO_FATAL_FAILURE(StepAll(**a, 0, 3));
  const size_t workspace = (*a)->workspace_bytes();
  ASSERT_GT(workspace, kStashBytes * 9 / 10);

  // Head b (fp32 W and dW, 8 bytes per element) needs half a stash more than is free.
  const size_t free = (*gpu)->memory_info().free_bytes;
  const int64_t rows = static_cast<int64_t>((free + kStashBytes / 2) / (kD * 8));
  auto b = registry.Create(Spec("b", rows, v1::DTYPE_FP32));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_LT((*a)->workspace_bytes(), workspace - kStashBytes * 9 / 10);
  std::printf(
      "[figures] stash %zu MiB given back: head a's workspace %zu -> %zu MiB; head b "
      "%lld x %lld fp32 (%zu MiB) created where %zu MiB were free\n",
      kStashBytes / kMiB, workspace / kMiB, (*a)->workspace_bytes() / kMiB,
      static_cast<long long>(rows), static_cast<long long>(kD),
      static_cast<size_t>(rows) * kD * 8 / kMiB, free / kMiB);

  // a goes on without a stash; its window holds all six micro-batches.
  ASSERT_NO_FATAL_FAILURE(StepAll(**a, 3, 3));
  const std::vector<float> got = PullDw(**a);
  ASSERT_EQ(got.size(), want.size());
  // The stash rounds each micro-batch's G to bf16 after its 1/N scale, the direct run before it:
  // the two agree within the suite's bf16 bound (relative norm), where a micro-batch lost or
  // counted twice would move dW by about a sixth.
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    diff += e * e;
    norm += static_cast<double>(want[i]) * want[i];
  }
  const double relative = std::sqrt(diff / norm);
  EXPECT_LE(relative, kernels::ToleranceFor(kernels::DType::kBF16, false).dw)
      << "dW differs from the run without a stash";
  std::printf(
      "[figures] dW against the run without a stash: relative norm of the difference %.3g\n",
      relative);
}

}  // namespace
}  // namespace losshead::server
