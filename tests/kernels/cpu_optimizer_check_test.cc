// Backend::CheckOptimizerStep on the CPU backend: it writes nothing, finds exactly what the step
// then does (each element that overflows, the largest new magnitudes), and
// kernels::StepMagnitudeBound, which lets an apply skip it, is never below what a step reaches.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/optimizer.h"
#include "tests/kernels/optimizer_check_runner.h"

namespace losshead::kernels::testing {
namespace {

constexpr float kFp32Max = std::numeric_limits<float>::max();

std::unique_ptr<Backend> Cpu(int threads = 4) { return CreateCpuBackend(threads); }

void ExpectSameCheck(const OptimizerCheck& actual, const OptimizerCheck& expected) {
  EXPECT_EQ(actual.nonfinite, expected.nonfinite);
  EXPECT_EQ(actual.weight, expected.weight);
  EXPECT_EQ(actual.state_a, expected.state_a);
  EXPECT_EQ(actual.state_b, expected.state_b);
}

// Every optimizer variant and dtype of the standard cases on their odd shape (a scalar tail),
// in both scenarios of MakeCheckScenario.
struct CheckCase {
  OptimizerCase base;
  bool overflow = false;
};

std::vector<CheckCase> CheckCases() {
  std::vector<CheckCase> cases;
  for (const OptimizerCase& c : StandardOptimizerCases()) {
    if (c.rows != 257) continue;
    for (bool overflow : {false, true}) {
      CheckCase k{c, overflow};
      k.base.name += overflow ? "_overflow" : "_tame";
      cases.push_back(k);
    }
  }
  return cases;
}

class CpuOptimizerCheckTest : public ::testing::TestWithParam<CheckCase> {};

TEST_P(CpuOptimizerCheckTest, FindsExactlyWhatTheStepDoesAndWritesNothing) {
  const CheckCase& k = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  const CheckScenario scenario = MakeCheckScenario(k.base, k.overflow, rng);
  const OptimizerProblem& problem = scenario.problem;
  ASSERT_TRUE(ValidateOptimizerProblem(problem).ok());
  const StepStart& start = scenario.start;
  std::unique_ptr<Backend> cpu = Cpu();
  for (int64_t offset : {0, 1}) {
    absl::StatusOr<CheckedStep> run = CheckThenStep(*cpu, problem, start, offset);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_TRUE(SameBits(run->after_check, run->before)) << "the check wrote to a buffer";
    ExpectSameCheck(run->check, CheckFromStep(problem.dtype, run->after_step));
    if (k.overflow) {
      EXPECT_GT(run->check.nonfinite, 0u) << Describe(run->check);
    } else {
      EXPECT_EQ(run->check.nonfinite, 0u) << Describe(run->check);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CpuOptimizerCheckTest, ::testing::ValuesIn(CheckCases()),
                         [](const auto& info) { return info.param.base.name; });

// A float, so that buffers built from it reach it exactly: log-uniform over [10^lo, 10^hi].
double LogUniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  return static_cast<float>(std::pow(10.0, exponent(rng)));
}

// Valid hyper-parameters of every kind and variant, over many decades.
OptimizerOptions RandomOptions(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  auto beta = [&] { return unit(rng) < 0.2f ? 0.0f : std::min(unit(rng), 0.9999f); };
  auto decay = [&] { return unit(rng) < 0.3f ? 0.0f : static_cast<float>(LogUniform(rng, -6, 2)); };
  const float lr =
      static_cast<float>(unit(rng) < 0.8f ? LogUniform(rng, -8, 2) : LogUniform(rng, 2, 37));
  switch (rng() % 3) {
    case 0:
      return AdamWOptions{.lr = lr,
                          .beta1 = beta(),
                          .beta2 = beta(),
                          .eps = static_cast<float>(LogUniform(rng, -12, 0)),
                          .weight_decay = decay()};
    case 1: {
      SgdOptions o{.lr = lr, .weight_decay = decay()};
      if (unit(rng) < 0.7f) {
        o.momentum = unit(rng) * 1.5f;
        o.nesterov = unit(rng) < 0.3f;
        o.dampening = o.nesterov ? 0.0f : unit(rng) * 3.0f - 1.0f;
        o.init_momentum_buffer = unit(rng) < 0.3f;
      }
      return o;
    }
    default:
      return LionOptions{.lr = lr, .beta1 = unit(rng), .beta2 = unit(rng), .weight_decay = decay()};
  }
}

std::string DescribeProblem(const OptimizerProblem& p) {
  std::string s = absl::StrCat(DTypeName(p.dtype), " count ", p.count, " step ", p.step,
                               " grad_scale ", p.grad_scale, " ");
  if (const auto* o = std::get_if<AdamWOptions>(&p.options)) {
    absl::StrAppend(&s, "adamw lr ", o->lr, " betas ", o->beta1, " ", o->beta2, " eps ", o->eps,
                    " wd ", o->weight_decay);
  }
  if (const auto* o = std::get_if<SgdOptions>(&p.options)) {
    absl::StrAppend(&s, "sgd lr ", o->lr, " momentum ", o->momentum, " dampening ", o->dampening,
                    " nesterov ", o->nesterov, " wd ", o->weight_decay, " init ",
                    o->init_momentum_buffer);
  }
  if (const auto* o = std::get_if<LionOptions>(&p.options)) {
    absl::StrAppend(&s, "lion lr ", o->lr, " betas ", o->beta1, " ", o->beta2, " wd ",
                    o->weight_decay);
  }
  return s;
}

// Soundness: over random problems, dtypes and start magnitudes (each reached by some element),
// no new value exceeds StepMagnitudeBound, and where the bound stays in range no element
// overflows. Both sides of the range are drawn often enough to be tested.
TEST(StepMagnitudeBoundTest, NoStepExceedsItsBound) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::unique_ptr<Backend> cpu = Cpu(1);
  int in_range = 0, out_of_range = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    OptimizerProblem problem;
    problem.count = 1 + static_cast<int64_t>(rng() % 40);
    problem.dtype = std::array{DType::kFP32, DType::kBF16, DType::kFP16}[rng() % 3];
    problem.options = RandomOptions(rng);
    problem.step = 1 + static_cast<int64_t>(rng() % 1000);
    const double weight_hi = problem.dtype == DType::kFP16 ? 4.8 : 38;
    const OptimizerMagnitudes reach{.weight = LogUniform(rng, -6, weight_hi),
                                    .state_a = LogUniform(rng, -8, 30),
                                    .state_b = LogUniform(rng, -16, 37)};
    const double grad_abs = LogUniform(rng, -6, 20);
    problem.grad_scale = static_cast<float>(LogUniform(rng, -8, 0));
    if (!ValidateOptimizerProblem(problem).ok()) continue;
    const OptimizerMagnitudes bound = StepMagnitudeBound(problem, reach, grad_abs);
    const StepStart start = StartWithin(problem, reach, grad_abs, rng);
    absl::StatusOr<CheckedStep> run = CheckThenStep(*cpu, problem, start);
    ASSERT_TRUE(run.ok()) << run.status();
    const OptimizerCheck reached = CheckFromStep(problem.dtype, run->after_step);
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << ": " << DescribeProblem(problem) << "; reach "
                 << reach.weight << " " << reach.state_a << " " << reach.state_b << " grad "
                 << grad_abs << "; bound " << bound.weight << " " << bound.state_a << " "
                 << bound.state_b << ", reached " << Describe(reached));
    // A bound past fp32's range allows anything, Inf included.
    if (bound.weight <= kFp32Max) EXPECT_LE(reached.weight, bound.weight);
    if (bound.state_a <= kFp32Max) EXPECT_LE(reached.state_a, bound.state_a);
    if (bound.state_b <= kFp32Max) EXPECT_LE(reached.state_b, bound.state_b);
    if (StepStaysInRange(problem.dtype, bound)) {
      ++in_range;
      EXPECT_EQ(reached.nonfinite, 0u);
    } else {
      ++out_of_range;
    }
    if (HasFailure()) return;
  }
  EXPECT_GT(in_range, 300);
  EXPECT_GT(out_of_range, 300);
}

TEST(StepMagnitudeBoundTest, RangeIsTheDtypes) {
  EXPECT_TRUE(StepStaysInRange(DType::kFP16, {.weight = 65504}));
  EXPECT_FALSE(StepStaysInRange(DType::kFP16, {.weight = 65505}));
  EXPECT_TRUE(StepStaysInRange(DType::kBF16, {.weight = 3.3e38}));
  EXPECT_FALSE(StepStaysInRange(DType::kBF16, {.weight = 3.39e38}));
  EXPECT_TRUE(StepStaysInRange(DType::kFP32, {.weight = 3.4e38}));
  EXPECT_FALSE(StepStaysInRange(DType::kFP32, {.weight = 3.41e38}));
  EXPECT_FALSE(StepStaysInRange(DType::kFP32, {.state_a = 3.41e38}));
  EXPECT_FALSE(StepStaysInRange(DType::kFP32, {.state_b = std::nan("")}));
}

TEST(CpuOptimizerCheckErrorsTest, ANullResultOrAnInvalidStepIsRefused) {
  std::unique_ptr<Backend> cpu = Cpu();
  absl::StatusOr<std::unique_ptr<Stream>> stream = cpu->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<float> w(8, 1.0f), g(8, 1.0f), a(8, 0.0f);
  OptimizerProblem problem{.count = 8, .dtype = DType::kFP32, .options = LionOptions{}};
  OptimizerTensors t{.weight = w.data(), .grad = g.data(), .exp_avg = a.data()};
  OptimizerCheck check;
  EXPECT_EQ(cpu->CheckOptimizerStep(problem, t, nullptr, **stream).code(),
            absl::StatusCode::kInvalidArgument);
  problem.step = 0;
  EXPECT_EQ(cpu->CheckOptimizerStep(problem, t, &check, **stream).code(),
            absl::StatusCode::kInvalidArgument);
  problem.step = 1;
  t.exp_avg = nullptr;
  EXPECT_EQ(cpu->CheckOptimizerStep(problem, t, &check, **stream).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::kernels::testing
