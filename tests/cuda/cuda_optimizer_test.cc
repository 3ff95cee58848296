// The CUDA optimizer step and gradient norm against the CPU backend on fresh random inputs.
//
// The step is elementwise and both backends share its per-element math with every fp32 operation
// rounded on its own (kernels/common/optimizer_math.h), so the results must agree bit for bit, on
// the vectorised path and on the scalar one. The norm's summation trees differ between backends:
// they agree to fp64 rounding, and each is bit-identical to itself.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "tests/kernels/optimizer_check_runner.h"
#include "tests/kernels/optimizer_runner.h"

namespace losshead::kernels {
namespace {

using testing::DoubleBits;
using testing::OptimizerCase;
using testing::OptimizerOutputs;
using testing::RandomGradient;

#define SKIP_WITHOUT_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

std::unique_ptr<Backend> MakeCuda() {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

void ExpectSameBits(const OptimizerOutputs& got, const OptimizerOutputs& want) {
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  };
  EXPECT_TRUE(same(got.param, want.param)) << "parameters differ";
  EXPECT_TRUE(got.weight == want.weight) << "rounded weights differ";
  EXPECT_TRUE(same(got.state_a, want.state_a)) << "state a differs";
  EXPECT_TRUE(same(got.state_b, want.state_b)) << "state b differs";
  for (float g : got.grad) ASSERT_EQ(g, 0.0f) << "dW is zeroed by the step";
}

std::vector<OptimizerCase> Cases() {
  std::vector<OptimizerCase> cases = testing::StandardOptimizerCases();
  // A shape large enough to span many blocks, with a tail of 3 elements after the vectors.
  for (const OptimizerCase& base : testing::StandardOptimizerCases()) {
    if (base.rows != 257) continue;
    OptimizerCase c = base;
    c.rows = 1031;
    c.cols = 1001;
    c.steps = 5;
    c.name = c.name.substr(0, c.name.rfind('_')) + "_1031x1001";
    cases.push_back(c);
  }
  return cases;
}

class CudaOptimizerTest : public ::testing::TestWithParam<OptimizerCase> {};

// `steps` steps of the case on the CUDA backend, its buffers `offset` elements into their
// allocations, against the CPU backend.
void CompareWithCpu(OptimizerCase c, int steps, uint64_t seed, int64_t offset) {
  c.steps = steps;
  const testing::OptimizerInputs in = testing::MakeOptimizerInputs(c, seed);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  OptimizerOutputs got, want;
  ASSERT_TRUE(testing::RunOptimizerSteps(*cuda, c, in, &got, offset).ok());
  ASSERT_TRUE(testing::RunOptimizerSteps(*CreateCpuBackend(), c, in, &want).ok());
  ExpectSameBits(got, want);
}

TEST_P(CudaOptimizerTest, MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  CompareWithCpu(GetParam(), GetParam().steps, /*seed=*/4321, /*offset=*/0);
}

TEST_P(CudaOptimizerTest, MisalignedBuffersTakeTheScalarPathWithTheSameBits) {
  SKIP_WITHOUT_GPU();
  CompareWithCpu(GetParam(), /*steps=*/3, /*seed=*/77, /*offset=*/1);
}

TEST_P(CudaOptimizerTest, RerunsAreBitIdentical) {
  SKIP_WITHOUT_GPU();
  OptimizerCase c = GetParam();
  c.steps = 2;
  const testing::OptimizerInputs in = testing::MakeOptimizerInputs(c, /*seed=*/5);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  OptimizerOutputs first, second;
  ASSERT_TRUE(testing::RunOptimizerSteps(*cuda, c, in, &first).ok());
  ASSERT_TRUE(testing::RunOptimizerSteps(*cuda, c, in, &second).ok());
  ExpectSameBits(second, first);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CudaOptimizerTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<OptimizerCase>& info) {
                           return info.param.name;
                         });

double NormOn(Backend& backend, const std::vector<float>& g, int64_t offset = 0) {
  absl::StatusOr<double> norm = testing::SquaredNormOn(backend, g, offset);
  EXPECT_TRUE(norm.ok()) << norm.status();
  return norm.value_or(-1.0);
}

// The step's check on the GPU, in both scenarios of MakeCheckScenario, on the vector and the
// scalar path: it writes nothing, finds exactly what the GPU's step then does, and gives the
// CPU backend's result bit for bit.
class CudaOptimizerCheckTest : public ::testing::TestWithParam<std::tuple<OptimizerCase, bool>> {};

void ExpectSameCheck(const OptimizerCheck& got, const OptimizerCheck& want) {
  EXPECT_EQ(got.nonfinite, want.nonfinite);
  EXPECT_EQ(got.weight, want.weight);
  EXPECT_EQ(got.state_a, want.state_a);
  EXPECT_EQ(got.state_b, want.state_b);
}

TEST_P(CudaOptimizerCheckTest, MatchesCpuAndTheStepItJudges) {
  SKIP_WITHOUT_GPU();
  const auto& [c, overflow] = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  const testing::CheckScenario scenario = testing::MakeCheckScenario(c, overflow, rng);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  auto want = testing::CheckThenStep(*CreateCpuBackend(), scenario.problem, scenario.start);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(want->check.nonfinite > 0, overflow) << testing::Describe(want->check);
  for (int64_t offset : {0, 1}) {
    auto got = testing::CheckThenStep(*cuda, scenario.problem, scenario.start, offset);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(testing::SameBits(got->after_check, got->before)) << "the check wrote";
    ExpectSameCheck(got->check, testing::CheckFromStep(c.dtype, got->after_step));
    ExpectSameCheck(got->check, want->check);
    // NaN's bits may differ between the devices; where nothing overflows, every bit is equal.
    if (!overflow) EXPECT_TRUE(testing::SameBits(got->after_step, want->after_step));
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CudaOptimizerCheckTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param).name +
                                  (std::get<1>(info.param) ? "_overflow" : "_tame");
                         });

TEST(CudaSquaredNormTest, Fp32_Sizes_MatchCpuAndRerunAndAlignmentKeepTheBits) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  // Below one unit per thread, a few units each, and many (with tails of 1..3 elements).
  for (int64_t count :
       {int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{1} << 20, int64_t{12345679}}) {
    SCOPED_TRACE(count);
    const std::vector<float> g = RandomGradient(count, count);
    const double want = NormOn(*cpu, g);
    const double got = NormOn(*cuda, g);
    EXPECT_NEAR(got, want, 1e-13 * want);
    EXPECT_EQ(DoubleBits(NormOn(*cuda, g)), DoubleBits(got));
    EXPECT_EQ(DoubleBits(NormOn(*cuda, g, /*offset=*/1)), DoubleBits(got));
  }
}

TEST(CudaSquaredNormTest, EmptyIsZeroAndNonFiniteShows) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  EXPECT_EQ(NormOn(*cuda, {}), 0.0);
  std::vector<float> g = RandomGradient(100003, 3);
  g[100002] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(NormOn(*cuda, g)));
  g[100002] = 1.0f;
  g[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(NormOn(*cuda, g)));
}

TEST(CudaOptimizerErrorsTest, InvalidStepOrForeignStreamLaunchesNothing) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Stream> stream = *cuda->CreateStream();
  constexpr int64_t kCount = 1000;
  DeviceBuffer weight = *cuda->Allocate(kCount * 4), grad = *cuda->Allocate(kCount * 4),
               a = *cuda->Allocate(kCount * 4), b = *cuda->Allocate(kCount * 4);
  const std::vector<float> ones(kCount, 1.0f);
  for (DeviceBuffer* buf : {&weight, &grad, &a, &b}) {
    ASSERT_TRUE(cuda->CopyToDevice(buf->data(), ones.data(), kCount * 4, *stream).ok());
  }
  OptimizerTensors t{.weight = weight.data(),
                     .grad = grad.as<float>(),
                     .exp_avg = a.as<float>(),
                     .exp_avg_sq = b.as<float>()};
  OptimizerProblem p{.count = kCount, .dtype = DType::kFP32, .options = AdamWOptions{}};
  p.options = AdamWOptions{.lr = std::numeric_limits<float>::quiet_NaN()};
  EXPECT_EQ(cuda->OptimizerStep(p, t, *stream).code(), absl::StatusCode::kInvalidArgument);
  p.options = AdamWOptions{};
  t.master = a.as<float>();  // fp32 weights are their own master
  EXPECT_EQ(cuda->OptimizerStep(p, t, *stream).code(), absl::StatusCode::kInvalidArgument);
  t.master = nullptr;
  std::unique_ptr<Stream> cpu_stream = *CreateCpuBackend(1)->CreateStream();
  EXPECT_EQ(cuda->OptimizerStep(p, t, *cpu_stream).code(), absl::StatusCode::kInvalidArgument);
  double* none = nullptr;
  EXPECT_EQ(cuda->SquaredNorm(grad.as<float>(), kCount, none, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda->SquaredNorm(grad.as<float>(), kCount, b.as<double>(), *cpu_stream).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> back(kCount);
  for (DeviceBuffer* buf : {&weight, &grad, &a, &b}) {
    ASSERT_TRUE(cuda->CopyToHost(back.data(), buf->data(), kCount * 4, *stream).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_EQ(back, ones);
  }
}

}  // namespace
}  // namespace losshead::kernels
