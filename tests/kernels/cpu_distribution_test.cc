// The distribution outputs of Run (Arguments, problem.h: log p of the target, entropy, argmax and
// the correct count) on the CPU backend against the float64 reference, on fresh random inputs;
// that asking for them changes no other output by a single bit; ties. The shards' and the top-k's:
// cpu_shard_distribution_test.cc; the CUDA backend's: tests/cuda.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/reference_loss.h"

namespace losshead::kernels {
namespace {

using testing::Inputs;
using testing::InputSpec;
using testing::MakeRandomInputs;
using testing::Outputs;
using testing::ReferenceLoss;
using testing::ReferenceResult;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::ToDouble;
using testing::WorstToleranceRatio;

RunOptions AllDistributionOutputs(size_t workspace_budget = size_t{64} << 20) {
  RunOptions options;
  options.workspace_budget = workspace_budget;
  options.logprob = options.entropy = options.argmax = options.correct_count = true;
  return options;
}

// Bit-for-bit equality of two fp32 vectors (NaN or not).
bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every output a call without the distribution outputs writes, bit for bit.
void ExpectSameLossOutputs(const Outputs& with, const Outputs& without) {
  EXPECT_EQ(std::memcmp(&with.loss_sum, &without.loss_sum, sizeof(float)), 0)
      << with.loss_sum << " vs " << without.loss_sum;
  EXPECT_EQ(with.token_count, without.token_count);
  EXPECT_TRUE(SameBits(with.per_token_loss, without.per_token_loss)) << "per_token_loss";
  EXPECT_TRUE(SameBits(with.per_token_lse, without.per_token_lse)) << "per_token_lse";
  EXPECT_TRUE(SameBits(with.grad_weight, without.grad_weight)) << "grad_weight";
  ASSERT_EQ(with.grad_hidden.size(), without.grad_hidden.size());
  for (size_t i = 0; i < with.grad_hidden.size(); ++i) {
    ASSERT_EQ(with.grad_hidden[i], without.grad_hidden[i]) << "grad_hidden[" << i << "]";
  }
}

// Sets the targets of every other counted token to the reference's argmax, so that the correct
// count is not just 0 on random targets.
void AimHalfTheTargets(Inputs& in) {
  const ReferenceResult ref = ReferenceLoss(in.problem, in.hidden, in.weight, in.targets);
  for (size_t t = 0; t < in.targets.size(); t += 2) {
    if (in.targets[t] != in.problem.options.ignore_index) in.targets[t] = ref.per_token_argmax[t];
  }
}

struct Case {
  std::string name;
  int64_t n, d, v;
  DType dtype;
  LossOptions options;
  size_t workspace_budget;  // small ones split the tokens into several chunks
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CpuDistributionTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuDistributionTest, MatchesFloat64ReferenceAndChangesNothingElse) {
  const Case& c = GetParam();
  const Problem p{.n = c.n, .d = c.d, .v = c.v, .dtype = c.dtype, .options = c.options};
  Inputs in =
      MakeRandomInputs(p, std::hash<std::string>()(c.name),
                       InputSpec{.hidden_scale = 1.0, .weight_scale = 0.7, .ignore_fraction = 0.3});
  AimHalfTheTargets(in);
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  RunOptions without_options;
  without_options.workspace_budget = c.workspace_budget;
  absl::StatusOr<Outputs> without = RunOnBackend(*backend, in, without_options);
  ASSERT_TRUE(without.ok()) << without.status();
  absl::StatusOr<Outputs> with =
      RunOnBackend(*backend, in, AllDistributionOutputs(c.workspace_budget));
  ASSERT_TRUE(with.ok()) << with.status();

  ExpectSameLossOutputs(*with, *without);

  // Values: the backend's logits are fp32 GEMMs of the same rounded inputs, its row sums double.
  constexpr double kRel = 2e-6;
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(with->per_token_logprob), ref.per_token_logprob, kRel, kRel),
      1.0)
      << "per_token_logprob";
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(with->per_token_entropy), ref.per_token_entropy, kRel, kRel),
      1.0)
      << "per_token_entropy";
  EXPECT_LE(WorstToleranceRatio(ToDouble(with->per_token_lse), ref.per_token_lse, kRel, kRel), 1.0)
      << "per_token_lse";

  // The argmax agrees wherever the reference's top two logits are further apart than the fp32
  // logits' error; a near-tie may go either way, and moves the correct count by at most one.
  int64_t near_ties = 0, correct_from_argmax = 0, counted = 0;
  for (int64_t t = 0; t < p.n; ++t) {
    const bool ignored = in.targets[t] == p.options.ignore_index;
    if (ignored) {
      EXPECT_EQ(with->per_token_logprob[t], 0.0f) << "token " << t;
      EXPECT_EQ(with->per_token_entropy[t], 0.0f) << "token " << t;
      EXPECT_EQ(with->per_token_argmax[t], -1) << "token " << t;
      continue;
    }
    ++counted;
    const int32_t argmax = with->per_token_argmax[t];
    ASSERT_GE(argmax, 0) << "token " << t;
    ASSERT_LT(argmax, p.v) << "token " << t;
    correct_from_argmax += argmax == in.targets[t] ? 1 : 0;
    EXPECT_LE(with->per_token_logprob[t], 0.0f) << "token " << t;
    EXPECT_GE(with->per_token_entropy[t], 0.0f) << "token " << t;
    EXPECT_LE(with->per_token_entropy[t], std::log(static_cast<double>(p.v)) * (1 + kRel))
        << "token " << t;
    if (ref.per_token_top_gap[t] <= 1e-4) {
      ++near_ties;
      continue;
    }
    EXPECT_EQ(argmax, ref.per_token_argmax[t]) << "token " << t;
  }
  EXPECT_LE(near_ties, p.n / 10) << "too many near-ties for the argmax check to mean anything";
  EXPECT_GT(counted, 0);
  EXPECT_GT(ref.correct_count, 0);
  EXPECT_EQ(with->correct_count, correct_from_argmax);
  EXPECT_LE(std::abs(with->correct_count - ref.correct_count), near_ties);

  // Without label smoothing and z-loss the loss is -log p_y, and the two are one subtraction.
  if (p.options.label_smoothing == 0.0f && p.options.z_loss == 0.0f) {
    for (int64_t t = 0; t < p.n; ++t) {
      if (in.targets[t] == p.options.ignore_index) continue;
      EXPECT_EQ(with->per_token_logprob[t], -with->per_token_loss[t]) << "token " << t;
    }
  }
}

LossOptions Options(Reduction reduction, float label_smoothing = 0.0f, float z_loss = 0.0f,
                    float softcap = 0.0f) {
  return {.reduction = reduction,
          .label_smoothing = label_smoothing,
          .z_loss = z_loss,
          .softcap = softcap};
}

LossOptions IgnoringClassZero() {
  LossOptions options = Options(Reduction::kMean);
  options.ignore_index = 0;
  return options;
}

constexpr size_t kWhole = size_t{64} << 20;
constexpr size_t kChunked = size_t{96} << 10;

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuDistributionTest,
    ::testing::Values(
        Case{"BF16_Plain", 37, 67, 1000, DType::kBF16, Options(Reduction::kMean), kWhole},
        Case{"FP32_Plain_Chunked", 150, 67, 997, DType::kFP32, Options(Reduction::kSum), kChunked},
        Case{"BF16_SmoothingZLoss", 37, 67, 1000, DType::kBF16,
             Options(Reduction::kMean, 0.1f, 1e-3f), kWhole},
        Case{"FP32_Softcap", 37, 67, 1000, DType::kFP32, Options(Reduction::kMean, 0, 0, 2.0f),
             kWhole},
        Case{"BF16_Everything_Chunked", 150, 67, 997, DType::kBF16,
             Options(Reduction::kNone, 0.1f, 1e-3f, 3.0f), kChunked},
        Case{"FP16_Everything", 37, 67, 1000, DType::kFP16,
             Options(Reduction::kSum, 0.05f, 1e-4f, 30.0f), kWhole},
        // ignore_index is a class: a token aimed at class 0 is ignored, whatever its argmax.
        Case{"FP32_IgnoreIndexInVocab", 200, 67, 5, DType::kFP32, IgnoringClassZero(), kWhole}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Inputs of small integers: every logit is an exact integer in fp32 (whatever order the GEMM
// sums in), so ties are exact and frequent, and the lowest id must win.
Inputs IntegerInputs(const Problem& p, uint64_t seed) {
  Inputs in = MakeRandomInputs(p, seed);
  std::vector<float> f(std::max(in.hidden.size(), in.weight.size()));
  auto integers = [&](std::vector<double>& values, std::vector<uint8_t>& bytes) {
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = std::round(values[i] * 1.5);  // U(-1, 1) to {-1, 0, 1}
      f[i] = static_cast<float>(values[i]);
    }
    FromFloat(p.dtype, f.data(), bytes.data(), values.size());
  };
  integers(in.hidden, in.hidden_bytes);
  integers(in.weight, in.weight_bytes);
  // Token 0 sees all-zero logits: a V-way tie, won by id 0.
  for (int64_t k = 0; k < p.d; ++k) in.hidden[k] = 0.0;
  std::memset(in.hidden_bytes.data(), 0, p.d * DTypeSize(p.dtype));
  return in;
}

TEST(CpuDistributionTies, LowestIdOfTheMaxWins) {
  for (float softcap : {0.0f, 5.0f}) {
    for (DType dtype : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(::testing::Message() << "softcap " << softcap << " " << DTypeName(dtype));
      const Problem p{.n = 64,
                      .d = 6,
                      .v = 50,
                      .dtype = dtype,
                      .options = Options(Reduction::kMean, 0, 0, softcap)};
      Inputs in = IntegerInputs(p, 43 + static_cast<int>(dtype));
      in.targets[5] = static_cast<int32_t>(p.options.ignore_index);
      AimHalfTheTargets(in);
      const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
      int64_t tied = 0;
      for (int64_t t = 0; t < p.n; ++t) tied += ref.per_token_top_gap[t] == 0.0 ? 1 : 0;
      std::unique_ptr<Backend> backend = CreateCpuBackend(2);
      absl::StatusOr<Outputs> out = RunOnBackend(*backend, in, AllDistributionOutputs());
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->per_token_argmax, ref.per_token_argmax);
      EXPECT_EQ(out->per_token_argmax[0], 0);
      EXPECT_EQ(out->correct_count, ref.correct_count);
      EXPECT_GT(ref.correct_count, 0);
      // The reference's argmax is the first max; make sure ties beyond it were there to break.
      int64_t ties_at_max = 0;
      for (int64_t t = 0; t < p.n; ++t) {
        if (in.targets[t] == p.options.ignore_index) continue;
        const double* h = &in.hidden[t * p.d];
        double best = -INFINITY;
        int count = 0;
        for (int64_t j = 0; j < p.v; ++j) {
          double x = 0.0;
          for (int64_t k = 0; k < p.d; ++k) x += h[k] * in.weight[j * p.d + k];
          if (x > best) {
            best = x;
            count = 1;
          } else if (x == best) {
            ++count;
          }
        }
        ties_at_max += count > 1 ? 1 : 0;
      }
      EXPECT_GT(ties_at_max, p.n / 4) << tied;
    }
  }
}

// Each output alone (the others null) is the value it has when all are asked for, and the loss
// outputs stay what they are whichever is asked for.
TEST(CpuDistributionSubsets, EachOutputAloneMatchesAllTogether) {
  const Problem p{.n = 40,
                  .d = 33,
                  .v = 301,
                  .dtype = DType::kBF16,
                  .options = Options(Reduction::kMean, 0.1f, 1e-3f, 10.0f)};
  Inputs in = MakeRandomInputs(p, 4301, InputSpec{.ignore_fraction = 0.25});
  AimHalfTheTargets(in);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  absl::StatusOr<Outputs> all = RunOnBackend(*backend, in, AllDistributionOutputs());
  ASSERT_TRUE(all.ok()) << all.status();
  for (int which = 0; which < 4; ++which) {
    SCOPED_TRACE(which);
    RunOptions options;
    options.logprob = which == 0;
    options.entropy = which == 1;
    options.argmax = which == 2;
    options.correct_count = which == 3;
    absl::StatusOr<Outputs> one = RunOnBackend(*backend, in, options);
    ASSERT_TRUE(one.ok()) << one.status();
    ExpectSameLossOutputs(*one, *all);
    if (options.logprob) EXPECT_TRUE(SameBits(one->per_token_logprob, all->per_token_logprob));
    if (options.entropy) EXPECT_TRUE(SameBits(one->per_token_entropy, all->per_token_entropy));
    if (options.argmax) EXPECT_EQ(one->per_token_argmax, all->per_token_argmax);
    if (options.correct_count) EXPECT_EQ(one->correct_count, all->correct_count);
  }
  EXPECT_GT(all->correct_count, 0);

  // A forward-only call (no dH, no dW) gives the same values: the row is read before any
  // gradient overwrites it.
  RunOptions forward = AllDistributionOutputs();
  forward.grad_hidden = forward.grad_weight = false;
  absl::StatusOr<Outputs> forward_only = RunOnBackend(*backend, in, forward);
  ASSERT_TRUE(forward_only.ok()) << forward_only.status();
  EXPECT_TRUE(SameBits(forward_only->per_token_logprob, all->per_token_logprob));
  EXPECT_TRUE(SameBits(forward_only->per_token_entropy, all->per_token_entropy));
  EXPECT_EQ(forward_only->per_token_argmax, all->per_token_argmax);
  EXPECT_EQ(forward_only->correct_count, all->correct_count);
  EXPECT_TRUE(SameBits(forward_only->per_token_loss, all->per_token_loss));
}

TEST(KernelDistributionOutputs, RequestedAreNamedInFieldOrder) {
  Arguments args;
  EXPECT_EQ(RequestedDistributionOutputs(args), "");
  float f = 0.0f;
  int32_t i = 0;
  int64_t count = 0;
  args.per_token_entropy = &f;
  EXPECT_EQ(RequestedDistributionOutputs(args), "per_token_entropy");
  args.per_token_logprob = &f;
  args.per_token_argmax = &i;
  args.correct_count = &count;
  EXPECT_EQ(RequestedDistributionOutputs(args),
            "per_token_logprob, per_token_entropy, per_token_argmax, correct_count");
  EXPECT_FALSE(AsksTopK(args));
  float logprobs[2];
  args.top_k_logprobs = logprobs;
  EXPECT_TRUE(AsksTopK(args));
  EXPECT_EQ(RequestedDistributionOutputs(args),
            "per_token_logprob, per_token_entropy, per_token_argmax, correct_count, "
            "top_k_logprobs");
  // The top-k alone is a distribution output.
  Arguments top_only;
  top_only.top_k_ids = &i;
  EXPECT_TRUE(AsksDistributionOutputs(top_only));
  EXPECT_EQ(RequestedDistributionOutputs(top_only), "top_k_ids");
}

// A bad call that asks for the outputs is refused before anything is written.
TEST(CpuDistributionErrors, BadTargetWritesNoOutput) {
  const Problem p{.n = 8, .d = 16, .v = 64, .dtype = DType::kFP32};
  Inputs in = MakeRandomInputs(p, 7);
  in.targets[3] = 64;
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  std::vector<float> logprob(p.n, 7.0f), entropy(p.n, 7.0f);
  std::vector<int32_t> argmax(p.n, 7);
  int64_t correct = 7, token_count = 7;
  float loss_sum = 7.0f;
  absl::StatusOr<size_t> bytes = backend->WorkspaceBytes(p, size_t{1} << 20);
  ASSERT_TRUE(bytes.ok());
  std::vector<char> workspace(*bytes);
  Arguments args;
  args.hidden = in.hidden_bytes.data();
  args.weight = in.weight_bytes.data();
  args.targets = in.targets.data();
  args.loss_sum = &loss_sum;
  args.token_count = &token_count;
  args.per_token_logprob = logprob.data();
  args.per_token_entropy = entropy.data();
  args.per_token_argmax = argmax.data();
  args.correct_count = &correct;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.size();
  auto stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ(backend->Run(p, args, **stream).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(logprob, std::vector<float>(p.n, 7.0f));
  EXPECT_EQ(entropy, std::vector<float>(p.n, 7.0f));
  EXPECT_EQ(argmax, std::vector<int32_t>(p.n, 7));
  EXPECT_EQ(correct, 7);
  in.targets[3] = 1;
  EXPECT_TRUE(backend->Run(p, args, **stream).ok());
  EXPECT_NE(argmax, std::vector<int32_t>(p.n, 7));
}

}  // namespace
}  // namespace losshead::kernels
