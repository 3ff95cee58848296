// On a GPU, the deferred-dW stash gives way to a head that needs its memory: a head that fits the
// device only without another head's stash is created, the stash is added to dW first (the
// window equals that of the same micro-batches run without a stash, up to summation order), and
// the first head goes on adding to dW directly; and a larger micro-batch of another head takes an
// idle head's stash. tests/server/stash_memory_test.cc covers the rest on a CPU device with a
// memory limit.
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

MicroBatch Batch(int i, const std::string& head = "a", int64_t n = 0) {
  if (n == 0) n = 1024 + 256 * i;
  std::mt19937_64 rng(300 + i);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(n * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(n);
  std::uniform_int_distribution<int32_t> pick(0, kV - 1);
  for (int64_t t = 0; t < n; ++t) y[t] = t % 9 == 4 ? -100 : pick(rng);
  return Bf16MicroBatch(head, "c", i + 1, h, y);
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

// ||got - want|| / ||want||.
double RelativeNorm(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    diff += e * e;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

size_t FreeBytes(kernels::Backend& gpu) { return gpu.memory_info().free_bytes; }

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
  const double relative = RelativeNorm(got, want);
  EXPECT_LE(relative, kernels::ToleranceFor(kernels::DType::kBF16, false).dw)
      << "dW differs from the run without a stash";
  std::printf(
      "[figures] dW against the run without a stash: relative norm of the difference %.3g\n",
      relative);
}

// A micro-batch of head b whose buffers do not fit the GPU takes head a's idle stash, with the
// driver's own free memory: ballast buffers leave b room for its small micro-batch's buffers but
// not for a stash of its own, and then half a stash too little for its large one.
TEST(StashMemoryCudaTest, ALargerMicroBatchOfAnotherHeadGetsAnIdleHeadsStash) {
  if (kernels::CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  auto gpu = kernels::CreateBackend(kernels::BackendKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  constexpr size_t kLent = size_t{512} << 20;
  constexpr int64_t kSmall = 256, kLarge = 8192;

  // What a head's buffers take for the small micro-batch, and what the large one adds; and the
  // window of a's micro-batches 0-2 without a stash.
  size_t small = 0, growth = 0;
  std::vector<float> want;
  {
    auto m = Head::Create(**gpu, Spec("a", kV, v1::DTYPE_BF16), HeadOptions{});
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_NO_FATAL_FAILURE(StepAll(**m, 0, 3));
    want = PullDw(**m);
  }
  {
    auto m = Head::Create(**gpu, Spec("b", kV, v1::DTYPE_BF16), HeadOptions{});
    ASSERT_TRUE(m.ok()) << m.status();
    StepStats stats;
    const size_t before = FreeBytes(**gpu);
    ASSERT_TRUE((*m)->Step(Batch(10, "b", kSmall), &stats).ok());
    const size_t after_small = FreeBytes(**gpu);
    ASSERT_TRUE((*m)->Step(Batch(11, "b", kLarge), &stats).ok());
    small = before - after_small;
    growth = after_small - FreeBytes(**gpu);
  }
  ASSERT_GT(growth, kLent / 2) << "the large micro-batch must need more than half a stash";

  HeadRegistry registry(
      **gpu, HeadOptions{.grad_stash_bytes = kLent, .grad_stash_idle = absl::InfiniteDuration()});
  auto a = registry.Create(Spec("a", kV, v1::DTYPE_BF16));
  auto b = registry.Create(Spec("b", kV, v1::DTYPE_BF16));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_NO_FATAL_FAILURE(StepAll(**a, 0, 3));
  const size_t workspace = (*a)->workspace_bytes();
  ASSERT_GT(workspace, kLent * 9 / 10);

  StepStats stats;
  auto first_ballast = (*gpu)->Allocate(FreeBytes(**gpu) - small - kLent / 2);
  ASSERT_TRUE(first_ballast.ok()) << first_ballast.status();
  auto first = (*b)->Step(Batch(10, "b", kSmall), &stats);
  ASSERT_TRUE(first.ok()) << first.status() << " (small " << small << ", growth " << growth
                          << ", free " << FreeBytes(**gpu) << ")";
  ASSERT_LT((*b)->workspace_bytes(), kLent / 2) << "b must have found no room for a stash";
  // Its large micro-batch then finds at most half a stash too little free.
  kernels::DeviceBuffer second_ballast;
  if (FreeBytes(**gpu) > growth - kLent / 2) {
    auto more = (*gpu)->Allocate(FreeBytes(**gpu) - (growth - kLent / 2));
    ASSERT_TRUE(more.ok()) << more.status();
    second_ballast = *std::move(more);
  }
  const size_t free = FreeBytes(**gpu);
  ASSERT_LT(free, growth);
  auto large = (*b)->Step(Batch(11, "b", kLarge), &stats);
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_LT((*a)->workspace_bytes(), workspace - kLent * 9 / 10);
  std::printf(
      "[figures] head b's %lld-token micro-batch needed %zu MiB with %zu MiB free: head a's "
      "workspace %zu -> %zu MiB\n",
      static_cast<long long>(kLarge), growth / kMiB, free / kMiB, workspace / kMiB,
      (*a)->workspace_bytes() / kMiB);

  // Nothing a counted is lost.
  const std::vector<float> got = PullDw(**a);
  ASSERT_EQ(got.size(), want.size());
  const double relative = RelativeNorm(got, want);
  EXPECT_LE(relative, kernels::ToleranceFor(kernels::DType::kBF16, false).dw);
  std::printf("[figures] a's dW against the run without a stash: relative norm %.3g\n", relative);
}

}  // namespace
}  // namespace losshead::server
