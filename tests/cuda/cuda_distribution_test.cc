// The distribution outputs and the top-k (Arguments, problem.h) on the CUDA backend: Run and the
// vocabulary shards against the CPU backend and the float64 references, on random bf16, fp16 and
// fp32 problems with ignored tokens, the loss options on and off, deferred dW on and off.
//
// Tolerances (DistributionTolerance, the near-tie rule of tests/kernels/distribution_checks.h):
//   fp32 logits (fp32 and fp16 problems, bf16 without bf16_logits): the logits are fp32 GEMMs in
//     another summation order than the CPU's and the row's exp is __expf: values within 1e-4
//     (relative plus absolute), ids equal wherever the float64 gap exceeds 1e-4.
//   bf16 logits (the default for bf16): each z is rounded to bf16 (2^-9 relative) before the row
//     reads it: values within 2e-2, ids equal wherever the float64 gap exceeds 4e-2 (more than a
//     bf16 step at |z| < 8, so that rounding both sides cannot swap them). The top few of a
//     thousand random logits are that close often (a top-3 on about half the tokens), so up to 80 %
//     of the tokens may be near-ties; their ids must still be among the near-tied classes.
// Whatever the tolerance: an ignored token's outputs are exactly 0, 0, -1 and ids -1 / log-probs
// 0; the correct count is that of the argmax returned; asking for the outputs changes no other
// output by a bit; and on inputs whose logits are exact (one-hot H), ties go to the lowest id and
// one-ulp near-ties to the larger z, exactly as float64 orders them.
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "tests/cuda/cuda_testing.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/distribution_checks.h"
#include "tests/kernels/reference_loss.h"
#include "tests/kernels/reference_topk.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

using testing::AimEveryOtherTarget;
using testing::CheckTopK;
using testing::DistributionTolerance;
using testing::ExpectDistributionMatchesReference;
using testing::ExpectDistributionsAgree;
using testing::ExpectSameLossBits;
using testing::Inputs;
using testing::InputSpec;
using testing::LadderInputs;
using testing::MakeCuda;
using testing::MakeRandomInputs;
using testing::Outputs;
using testing::ReferenceLoss;
using testing::ReferenceResult;
using testing::ReferenceTopK;
using testing::ReferenceTopKResult;
using testing::RunOnBackend;
using testing::RunOptions;
using testing::RunSharded;
using testing::TopKCheck;

constexpr size_t kMiB = size_t{1} << 20;

RunOptions AllOutputs(int32_t top_k, size_t budget, bool stash = false) {
  RunOptions options;
  options.workspace_budget = budget;
  options.logprob = options.entropy = options.argmax = options.correct_count = true;
  options.top_k = top_k;
  options.stash = stash;
  return options;
}

bool Bf16Logits(const Problem& p, const CudaBackendOptions& o) {
  return p.dtype == DType::kBF16 && o.bf16_logits;
}

DistributionTolerance ToleranceFor(const Problem& p, const CudaBackendOptions& o) {
  if (Bf16Logits(p, o)) return {.rel = 2e-2, .near_tie = 4e-2, .max_near_tie_share = 0.8};
  return {.rel = 1e-4, .near_tie = 1e-4};
}

LossOptions Options(Reduction reduction, float label_smoothing = 0.0f, float z_loss = 0.0f,
                    float softcap = 0.0f) {
  return {.reduction = reduction,
          .label_smoothing = label_smoothing,
          .z_loss = z_loss,
          .softcap = softcap};
}

struct Case {
  std::string name;
  DType dtype;
  LossOptions options;
  int64_t n = 97, d = 64, v = 1003;
  int32_t top_k = 5;
  bool stash = false;
  bool bf16_logits = true;
  int row_threads = 512;
  bool overlap = false;
  int64_t chunk_rows = 0;  // 0: one chunk; else a budget for about this many rows per chunk
  // No gradient asked (evaluation): the row kernel has no second pass, and the top-k reads the
  // row once more on its own.
  bool forward_only = false;
  bool sm90_logits_gemm = false;  // our logits GEMM and its statistics, where the device runs it
};

// The workspace budget for chunks of about c.chunk_rows tokens: the cuBLAS part, the handle's
// reserve, scalars and slack, and per row its logits and its loss.
size_t BudgetFor(const Case& c, const CudaBackendOptions& o) {
  if (c.chunk_rows == 0) return 64 * kMiB;
  const bool narrow = c.bf16_logits && c.dtype == DType::kBF16;
  const size_t stats = narrow && c.sm90_logits_gemm ? (c.v / 8 * 8 + 255) / 256 * 4 : 0;
  const size_t row = ((c.v + 15) / 16 * 16) * (narrow ? 2 : 4) + 4 + stats;
  return o.cublas_workspace_bytes + o.handle_reserve_bytes + 4096 + c.chunk_rows * row;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class CudaDistributionTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaDistributionTest, MatchesTheCpuBackendAndFloat64) {
  SKIP_WITHOUT_GPU();
  const Case& c = GetParam();
  const Problem p{.n = c.n, .d = c.d, .v = c.v, .dtype = c.dtype, .options = c.options};
  Inputs in =
      MakeRandomInputs(p, std::hash<std::string>()(c.name),
                       InputSpec{.hidden_scale = 1.0, .weight_scale = 0.6, .ignore_fraction = 0.3});
  AimEveryOtherTarget(in);
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  const ReferenceTopKResult topk = ReferenceTopK(p, in.hidden, in.weight, in.targets, c.top_k);
  CudaBackendOptions o;
  o.bf16_logits = c.bf16_logits;
  o.row_threads = c.row_threads;
  o.overlap = c.overlap;
  o.sm90_logits_gemm = c.sm90_logits_gemm;
  std::unique_ptr<Backend> cuda = MakeCuda(o);
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend(4);
  const size_t budget = BudgetFor(c, o);
  if (c.chunk_rows > 0) {
    absl::StatusOr<size_t> bytes = cuda->WorkspaceBytes(p, budget);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
  }

  RunOptions asked = AllOutputs(c.top_k, budget, c.stash);
  asked.grad_hidden = asked.grad_weight = !c.forward_only;
  absl::StatusOr<Outputs> got = RunOnBackend(*cuda, in, asked);
  ASSERT_TRUE(got.ok()) << got.status();
  RunOptions plain_options;
  plain_options.workspace_budget = budget;
  plain_options.stash = c.stash;
  plain_options.grad_hidden = plain_options.grad_weight = !c.forward_only;
  absl::StatusOr<Outputs> plain = RunOnBackend(*cuda, in, plain_options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<Outputs> want = RunOnBackend(*cpu, in, AllOutputs(c.top_k, 64 * kMiB));
  ASSERT_TRUE(want.ok()) << want.status();

  ExpectSameLossBits(*got, *plain);
  const DistributionTolerance tol = ToleranceFor(p, o);
  {
    SCOPED_TRACE("CUDA against float64");
    ExpectDistributionMatchesReference(in, *got, ref, &topk, tol);
  }
  {
    SCOPED_TRACE("CUDA against CPU");
    ExpectDistributionsAgree(in, *got, *want, ref, &topk, tol);
  }
  // A rerun gives the same bits (the correct count is an integer sum).
  absl::StatusOr<Outputs> again = RunOnBackend(*cuda, in, asked);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(testing::SameFloatBits(again->per_token_entropy, got->per_token_entropy));
  EXPECT_TRUE(testing::SameFloatBits(again->top_k_logprobs, got->top_k_logprobs));
  EXPECT_EQ(again->top_k_ids, got->top_k_ids);
  EXPECT_EQ(again->correct_count, got->correct_count);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDistributionTest,
    ::testing::Values(
        Case{.name = "BF16_Plain",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kMean),
             .top_k = 3},
        Case{.name = "BF16_FP32Logits_Everything",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kMean, 0.1f, 1e-3f, 3.0f),
             .bf16_logits = false},
        Case{.name = "BF16_Stash_Softcap_Chunked",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kSum, 0.0f, 0.0f, 5.0f),
             .top_k = 3,
             .stash = true,
             .chunk_rows = 32},
        Case{.name = "FP32_Plain_Top16",
             .dtype = DType::kFP32,
             .options = Options(Reduction::kMean),
             .top_k = 16},
        Case{.name = "FP32_SmoothingZLoss_Stash_1024Threads",
             .dtype = DType::kFP32,
             .options = Options(Reduction::kNone, 0.1f, 1e-3f),
             .top_k = 1,
             .stash = true,
             .row_threads = 1024},
        Case{.name = "FP16_Everything_Overlap",
             .dtype = DType::kFP16,
             .options = Options(Reduction::kMean, 0.05f, 1e-4f, 30.0f),
             .n = 600,
             .top_k = 7,
             .overlap = true},
        // A wide row: many tiles per thread, the candidates' slow path, a tail of V % 8 columns.
        Case{.name = "FP32_WideVocab",
             .dtype = DType::kFP32,
             .options = Options(Reduction::kMean),
             .n = 40,
             .d = 32,
             .v = 32003,
             .top_k = 16},
        Case{.name = "BF16_ForwardOnly_Top16",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kMean),
             .top_k = 16,
             .forward_only = true},
        // Our logits GEMM (CudaBackendOptions::sm90_logits_gemm): the lse from its statistics
        // with the outputs' kernels reading the row for theirs, into the stash, chunked, and
        // forward only over a wide row with a tail.
        Case{.name = "BF16_Sm90Gemm_Stash_Chunked",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kSum),
             .top_k = 3,
             .stash = true,
             .chunk_rows = 32,
             .sm90_logits_gemm = true},
        Case{.name = "BF16_Sm90Gemm_ForwardOnly_WideVocab_Top16",
             .dtype = DType::kBF16,
             .options = Options(Reduction::kMean),
             .n = 40,
             .d = 32,
             .v = 32003,
             .top_k = 16,
             .forward_only = true,
             .sm90_logits_gemm = true},
        Case{.name = "FP32_ForwardOnly_WideVocab_1024Threads",
             .dtype = DType::kFP32,
             .options = Options(Reduction::kSum, 0.1f),
             .n = 40,
             .d = 32,
             .v = 32003,
             .top_k = 5,
             .row_threads = 1024,
             .forward_only = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Exact ties to the lowest id and one-ulp near-ties to the larger z, as float64 orders them, on
// Run and over shards: the logits of one-hot H are exact in every dtype.
TEST(CudaDistributionTies, ExactTiesAndNearTiesMatchFloat64Exactly) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (int64_t v : {int64_t{20}, int64_t{61}, int64_t{4099}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " v " << v);
      const Problem p{
          .n = 48, .d = 8, .v = v, .dtype = dtype, .options = Options(Reduction::kMean)};
      const Inputs in = LadderInputs(p, 4300 + v + static_cast<int>(dtype));
      const int32_t k = 16;
      const ReferenceTopKResult topk = ReferenceTopK(p, in.hidden, in.weight, in.targets, k);
      const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
      absl::StatusOr<Outputs> whole = RunOnBackend(*cuda, in, AllOutputs(k, 64 * kMiB));
      ASSERT_TRUE(whole.ok()) << whole.status();
      const TopKCheck check = CheckTopK(topk, whole->top_k_ids, whole->top_k_logprobs, 1e-5, 0.0);
      EXPECT_EQ(check.error, "");
      EXPECT_GT(check.exact_ties, p.n / 2) << "the inputs should hold exact ties";
      EXPECT_EQ(whole->per_token_argmax, ref.per_token_argmax);
      EXPECT_EQ(whole->correct_count, ref.correct_count);
      for (int shards : {2, 3}) {
        SCOPED_TRACE(::testing::Message() << shards << " shards");
        std::vector<Backend*> backends(shards, cuda.get());
        absl::StatusOr<Outputs> sharded =
            RunSharded(backends, nullptr, in, AllOutputs(k, 64 * kMiB));
        ASSERT_TRUE(sharded.ok()) << sharded.status();
        EXPECT_EQ(sharded->top_k_ids, whole->top_k_ids);
        EXPECT_EQ(sharded->per_token_argmax, ref.per_token_argmax);
        EXPECT_EQ(sharded->correct_count, ref.correct_count);
      }
    }
  }
}

// Shards on the GPU (one device, the statistics exchanged through the host) against the CPU
// backend's one-device Run and float64; asking changes no loss output of the shards.
struct ShardCase {
  std::string name;
  int shards;
  DType dtype;
  LossOptions options;
  int32_t top_k;
  bool bf16_logits = true;
};

void PrintTo(const ShardCase& c, std::ostream* os) { *os << c.name; }

class CudaShardDistributionTest : public ::testing::TestWithParam<ShardCase> {};

TEST_P(CudaShardDistributionTest, MatchesTheCpuBackendAndFloat64) {
  SKIP_WITHOUT_GPU();
  const ShardCase& c = GetParam();
  const Problem p{.n = 83, .d = 48, .v = 1501, .dtype = c.dtype, .options = c.options};
  Inputs in =
      MakeRandomInputs(p, std::hash<std::string>()(c.name),
                       InputSpec{.hidden_scale = 1.0, .weight_scale = 0.6, .ignore_fraction = 0.3});
  AimEveryOtherTarget(in);
  const ReferenceResult ref = ReferenceLoss(p, in.hidden, in.weight, in.targets);
  const ReferenceTopKResult topk = ReferenceTopK(p, in.hidden, in.weight, in.targets, c.top_k);
  CudaBackendOptions o;
  o.bf16_logits = c.bf16_logits;
  std::unique_ptr<Backend> cuda = MakeCuda(o);
  ASSERT_NE(cuda, nullptr);
  std::vector<Backend*> backends(c.shards, cuda.get());
  absl::StatusOr<Outputs> got = RunSharded(backends, nullptr, in, AllOutputs(c.top_k, 64 * kMiB));
  ASSERT_TRUE(got.ok()) << got.status();
  RunOptions plain_options;
  absl::StatusOr<Outputs> plain = RunSharded(backends, nullptr, in, plain_options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  std::unique_ptr<Backend> cpu = CreateCpuBackend(4);
  absl::StatusOr<Outputs> want = RunOnBackend(*cpu, in, AllOutputs(c.top_k, 64 * kMiB));
  ASSERT_TRUE(want.ok()) << want.status();

  ExpectSameLossBits(*got, *plain);
  const DistributionTolerance tol = ToleranceFor(p, o);
  {
    SCOPED_TRACE("CUDA shards against float64");
    ExpectDistributionMatchesReference(in, *got, ref, &topk, tol);
  }
  {
    SCOPED_TRACE("CUDA shards against the CPU backend");
    ExpectDistributionsAgree(in, *got, *want, ref, &topk, tol);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaShardDistributionTest,
    ::testing::Values(ShardCase{"Two_BF16", 2, DType::kBF16, Options(Reduction::kMean), 3},
                      ShardCase{"Three_BF16_FP32Logits_Everything", 3, DType::kBF16,
                                Options(Reduction::kMean, 0.1f, 1e-3f, 3.0f), 16, false},
                      ShardCase{"Four_FP32_Top1", 4, DType::kFP32, Options(Reduction::kSum), 1},
                      ShardCase{"Three_FP16_Softcap", 3, DType::kFP16,
                                Options(Reduction::kNone, 0, 0, 30.0f), 7}),
    [](const ::testing::TestParamInfo<ShardCase>& info) { return info.param.name; });

}  // namespace
}  // namespace losshead::kernels
