// Every way a call to the CPU backend can be refused, with its exact status code, and proof that a
// refused Run leaves its outputs untouched.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels {
namespace {

constexpr float kPoison = 12345.0f;

// A valid fp32 problem with host buffers for every argument; tests break one thing at a time.
class CpuBackendErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = CreateCpuBackend(2);
    problem_ = {.n = 4, .d = 8, .v = 16, .dtype = DType::kFP32};
    hidden_.assign(problem_.n * problem_.d, 0.25f);
    weight_.assign(problem_.v * problem_.d, -0.5f);
    targets_ = {0, 15, -100, 3};
    grad_hidden_.assign(hidden_.size(), kPoison);
    grad_weight_.assign(weight_.size(), kPoison);
    per_token_loss_.assign(problem_.n, kPoison);
    per_token_lse_.assign(problem_.n, kPoison);
    absl::StatusOr<size_t> bytes = backend_->WorkspaceBytes(problem_, size_t{1} << 20);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    workspace_.assign(*bytes, 0);
    args_.hidden = hidden_.data();
    args_.weight = weight_.data();
    args_.targets = targets_.data();
    args_.grad_hidden = grad_hidden_.data();
    args_.grad_weight = grad_weight_.data();
    args_.loss_sum = &loss_sum_;
    args_.token_count = &token_count_;
    args_.per_token_loss = per_token_loss_.data();
    args_.per_token_lse = per_token_lse_.data();
    args_.workspace = workspace_.data();
    args_.workspace_bytes = workspace_.size();
    absl::StatusOr<std::unique_ptr<Stream>> stream = backend_->CreateStream();
    ASSERT_TRUE(stream.ok());
    stream_ = *std::move(stream);
  }

  absl::StatusCode RunCode(const Problem& problem) {
    return backend_->Run(problem, args_, *stream_).code();
  }

  void ExpectOutputsUntouched() {
    EXPECT_EQ(loss_sum_, kPoison);
    EXPECT_EQ(token_count_, -7);
    for (float x : grad_hidden_) ASSERT_EQ(x, kPoison);
    for (float x : grad_weight_) ASSERT_EQ(x, kPoison);
    for (float x : per_token_loss_) ASSERT_EQ(x, kPoison);
    for (float x : per_token_lse_) ASSERT_EQ(x, kPoison);
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  Problem problem_;
  std::vector<float> hidden_, weight_, grad_hidden_, grad_weight_, per_token_loss_, per_token_lse_;
  std::vector<int32_t> targets_;
  std::vector<uint8_t> workspace_;
  float loss_sum_ = kPoison;
  int64_t token_count_ = -7;
  Arguments args_;
};

TEST_F(CpuBackendErrorsTest, ValidFixtureRuns) {
  ASSERT_EQ(RunCode(problem_), absl::StatusCode::kOk);
  EXPECT_EQ(token_count_, 3);
  EXPECT_TRUE(std::isfinite(loss_sum_));
}

TEST_F(CpuBackendErrorsTest, MisalignedWorkspaceGivesTheSameResult) {
  ASSERT_EQ(RunCode(problem_), absl::StatusCode::kOk);
  const std::vector<float> aligned_grad_hidden = grad_hidden_;
  const float aligned_loss = loss_sum_;
  std::vector<uint8_t> larger(workspace_.size() + 3);
  args_.workspace = larger.data() + 3;
  args_.workspace_bytes = workspace_.size();
  ASSERT_EQ(RunCode(problem_), absl::StatusCode::kOk);
  EXPECT_EQ(grad_hidden_, aligned_grad_hidden);
  EXPECT_EQ(loss_sum_, aligned_loss);
}

TEST_F(CpuBackendErrorsTest, BadShapesAreInvalidArgument) {
  for (auto [n, d, v] : {std::tuple<int64_t, int64_t, int64_t>{0, 8, 16},
                         {4, 0, 16},
                         {4, 8, 0},
                         {-1, 8, 16},
                         {4, -3, 16},
                         {4, 8, int64_t{1} << 32}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n << " d=" << d << " v=" << v);
    Problem bad = problem_;
    bad.n = n;
    bad.d = d;
    bad.v = v;
    EXPECT_EQ(backend_->CanImplement(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(backend_->WorkspaceBytes(bad, size_t{1} << 20).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RunCode(bad), absl::StatusCode::kInvalidArgument);
  }
  ExpectOutputsUntouched();
}

TEST_F(CpuBackendErrorsTest, BadOptionsAreInvalidArgument) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<LossOptions> bad_options;
  for (float eps : {1.0f, -0.1f, 1.5f, nan}) bad_options.push_back({.label_smoothing = eps});
  for (float z : {-1e-3f, inf, nan}) bad_options.push_back({.z_loss = z});
  // A subnormal cap's reciprocal is Inf: the kernels would write NaN into every gradient.
  const float subnormal = std::numeric_limits<float>::denorm_min();
  for (float cap : {-1.0f, inf, nan, subnormal, 1e-40f, -1e-30f}) {
    bad_options.push_back({.softcap = cap});
  }
  for (float scale : {inf, nan}) bad_options.push_back({.grad_scale = scale});
  for (const LossOptions& options : bad_options) {
    Problem bad = problem_;
    bad.options = options;
    EXPECT_EQ(backend_->CanImplement(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RunCode(bad), absl::StatusCode::kInvalidArgument);
  }
  ExpectOutputsUntouched();
}

// A 16-bit problem's products are exact in fp32: only fp32 takes a faster precision.
TEST_F(CpuBackendErrorsTest, FasterPrecisionOutsideFp32OrOutOfRangeIsInvalidArgument) {
  std::vector<Problem> bad;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (MatmulPrecision precision : {MatmulPrecision::kHigh, MatmulPrecision::kMedium}) {
      Problem p = problem_;
      p.dtype = dtype;
      p.precision = precision;
      bad.push_back(p);
    }
  }
  Problem out_of_range = problem_;
  out_of_range.precision = static_cast<MatmulPrecision>(7);
  bad.push_back(out_of_range);
  for (const Problem& p : bad) {
    SCOPED_TRACE(::testing::Message()
                 << DTypeName(p.dtype) << " " << static_cast<int>(p.precision));
    EXPECT_EQ(backend_->CanImplement(p).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(backend_->WorkspaceBytes(p, size_t{1} << 20).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RunCode(p), absl::StatusCode::kInvalidArgument);
  }
  ExpectOutputsUntouched();
}

// The precision permits rounding; the CPU backend has no faster units and computes every one as
// highest, bit for bit.
TEST_F(CpuBackendErrorsTest, CpuComputesEveryPrecisionAsHighest) {
  ASSERT_EQ(RunCode(problem_), absl::StatusCode::kOk);
  const std::vector<float> highest_dh = grad_hidden_;
  const float highest_loss = loss_sum_;
  for (MatmulPrecision precision : {MatmulPrecision::kHigh, MatmulPrecision::kMedium}) {
    Problem p = problem_;
    p.precision = precision;
    grad_hidden_.assign(grad_hidden_.size(), kPoison);
    ASSERT_EQ(RunCode(p), absl::StatusCode::kOk);
    EXPECT_EQ(grad_hidden_, highest_dh) << MatmulPrecisionName(precision);
    EXPECT_EQ(loss_sum_, highest_loss) << MatmulPrecisionName(precision);
  }
}

TEST_F(CpuBackendErrorsTest, TargetOutsideVocabIsInvalidArgumentAndWritesNothing) {
  for (int32_t bad_target : {16, -1, 1 << 30, -101}) {
    SCOPED_TRACE(bad_target);
    targets_[3] = bad_target;  // the last token: earlier ones would be computed first if unchecked
    EXPECT_EQ(RunCode(problem_), absl::StatusCode::kInvalidArgument);
    ExpectOutputsUntouched();
  }
}

TEST_F(CpuBackendErrorsTest, NullRequiredPointerIsInvalidArgument) {
  const Arguments good = args_;
  for (int which = 0; which < 5; ++which) {
    SCOPED_TRACE(which);
    args_ = good;
    if (which == 0) args_.hidden = nullptr;
    if (which == 1) args_.weight = nullptr;
    if (which == 2) args_.targets = nullptr;
    if (which == 3) args_.loss_sum = nullptr;
    if (which == 4) args_.token_count = nullptr;
    EXPECT_EQ(RunCode(problem_), absl::StatusCode::kInvalidArgument);
  }
  ExpectOutputsUntouched();
}

TEST_F(CpuBackendErrorsTest, WorkspaceTooSmallIsInvalidArgument) {
  args_.workspace_bytes = 64;
  EXPECT_EQ(RunCode(problem_), absl::StatusCode::kInvalidArgument);
  args_.workspace_bytes = 0;
  EXPECT_EQ(RunCode(problem_), absl::StatusCode::kInvalidArgument);
  args_.workspace = nullptr;
  args_.workspace_bytes = workspace_.size();
  EXPECT_EQ(RunCode(problem_), absl::StatusCode::kInvalidArgument);
  ExpectOutputsUntouched();
}

TEST_F(CpuBackendErrorsTest, WorkspaceBudgetTooSmallIsResourceExhausted) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    Problem p = problem_;
    p.dtype = dtype;
    EXPECT_EQ(backend_->WorkspaceBytes(p, 0).status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(backend_->WorkspaceBytes(p, 100).status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  Problem huge_vocab = problem_;
  huge_vocab.v = 1 << 30;  // one fp32 logits row alone is 4 GiB
  EXPECT_EQ(backend_->WorkspaceBytes(huge_vocab, size_t{1} << 30).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(CpuBackendErrorsTest, NullMemoryOperandsAreInvalidArgument) {
  float x = 0;
  EXPECT_EQ(backend_->Memset(nullptr, 0, 4, *stream_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->CopyToDevice(nullptr, &x, 4, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->CopyToHost(&x, nullptr, 4, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::kernels
