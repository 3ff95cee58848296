// Every way an optimizer step or a norm can be refused, with its exact status code and the field
// its message names, and proof that a refused step leaves every buffer untouched.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace losshead::kernels {
namespace {

constexpr float kPoison = 12345.0f;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// INVALID_ARGUMENT with a message that names `text`.
void ExpectInvalid(const absl::Status& status, const std::string& text) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

// A valid bf16 AdamW step on host buffers; tests break one thing at a time.
class OptimizerErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = CreateCpuBackend(2);
    stream_ = *backend_->CreateStream();
    problem_.count = kCount;
    problem_.dtype = DType::kBF16;
    problem_.options = AdamWOptions{};
    weight_.assign(kCount, 0x3f80);  // 1.0 in bf16
    for (std::vector<float>* b : {&master_, &grad_, &a_, &b_, &momentum_})
      b->assign(kCount, kPoison);
    tensors_.weight = weight_.data();
    tensors_.master = master_.data();
    tensors_.grad = grad_.data();
    tensors_.exp_avg = a_.data();
    tensors_.exp_avg_sq = b_.data();
    tensors_.momentum_buffer = momentum_.data();
  }

  // The status of a step with `problem`, checked to change nothing when refused.
  absl::Status Step(const OptimizerProblem& problem) {
    absl::Status status = backend_->OptimizerStep(problem, tensors_, *stream_);
    if (!status.ok()) ExpectUntouched();
    return status;
  }

  // INVALID_ARGUMENT whose message names `field`, from both the validator and the backend.
  void ExpectRefused(const OptimizerProblem& problem, const std::string& field) {
    ExpectInvalid(ValidateOptimizerProblem(problem), field);
    ExpectInvalid(Step(problem), field);
  }

  void ExpectUntouched() {
    for (uint16_t w : weight_) ASSERT_EQ(w, 0x3f80);
    for (const std::vector<float>* b : {&master_, &grad_, &a_, &b_, &momentum_}) {
      for (float x : *b) ASSERT_EQ(x, kPoison);
    }
  }

  OptimizerProblem With(OptimizerOptions options) const {
    OptimizerProblem p = problem_;
    p.options = options;
    return p;
  }

  static constexpr int64_t kCount = 37;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  OptimizerProblem problem_;
  std::vector<uint16_t> weight_;
  std::vector<float> master_, grad_, a_, b_, momentum_;
  OptimizerTensors tensors_;
};

TEST_F(OptimizerErrorsTest, ValidFixtureSteps) {
  grad_.assign(kCount, 1.0f);
  master_.assign(kCount, 1.0f);
  a_.assign(kCount, 0.0f);
  b_.assign(kCount, 0.0f);
  ASSERT_TRUE(backend_->OptimizerStep(problem_, tensors_, *stream_).ok());
  EXPECT_EQ(grad_[0], 0.0f);
  EXPECT_LT(master_[0], 1.0f);
}

TEST_F(OptimizerErrorsTest, AdamWLearningRateNanInfOrNegative) {
  for (float lr : {kNan, kInf, -1e-3f}) ExpectRefused(With(AdamWOptions{.lr = lr}), "adamw.lr");
}

TEST_F(OptimizerErrorsTest, AdamWBetasOutsideZeroOne) {
  for (float beta : {-0.1f, 1.0f, 1.5f, kNan}) {
    ExpectRefused(With(AdamWOptions{.beta1 = beta}), "adamw.beta1");
    ExpectRefused(With(AdamWOptions{.beta2 = beta}), "adamw.beta2");
  }
}

TEST_F(OptimizerErrorsTest, AdamWEpsNotPositiveOrNotFinite) {
  for (float eps : {0.0f, -1e-8f, kNan, kInf}) {
    ExpectRefused(With(AdamWOptions{.eps = eps}), "adamw.eps");
  }
}

TEST_F(OptimizerErrorsTest, WeightDecayNegativeOrNotFinite) {
  for (float wd : {-0.1f, kNan, kInf}) {
    ExpectRefused(With(AdamWOptions{.weight_decay = wd}), "adamw.weight_decay");
    ExpectRefused(With(SgdOptions{.weight_decay = wd}), "sgd.weight_decay");
    ExpectRefused(With(LionOptions{.weight_decay = wd}), "lion.weight_decay");
  }
}

TEST_F(OptimizerErrorsTest, SgdLearningRateMomentumAndDampening) {
  for (float lr : {kNan, -kInf, -0.5f}) ExpectRefused(With(SgdOptions{.lr = lr}), "sgd.lr");
  for (float momentum : {-0.9f, kNan, kInf}) {
    ExpectRefused(With(SgdOptions{.momentum = momentum}), "sgd.momentum");
  }
  ExpectRefused(With(SgdOptions{.momentum = 0.9f, .dampening = kNan}), "sgd.dampening");
}

TEST_F(OptimizerErrorsTest, SgdNesterovNeedsMomentumAndNoDampening) {
  ExpectRefused(With(SgdOptions{.momentum = 0.0f, .nesterov = true}), "sgd.nesterov");
  ExpectRefused(With(SgdOptions{.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}),
                "sgd.nesterov");
  EXPECT_TRUE(ValidateOptimizerProblem(With(SgdOptions{.momentum = 0.9f, .nesterov = true})).ok());
}

TEST_F(OptimizerErrorsTest, LionLearningRateAndBetas) {
  ExpectRefused(With(LionOptions{.lr = kNan}), "lion.lr");
  for (float beta : {-0.1f, 1.01f, kNan}) {
    ExpectRefused(With(LionOptions{.beta1 = beta}), "lion.beta1");
    ExpectRefused(With(LionOptions{.beta2 = beta}), "lion.beta2");
  }
  EXPECT_TRUE(ValidateOptimizerProblem(With(LionOptions{.beta1 = 1.0f, .beta2 = 0.0f})).ok());
}

TEST_F(OptimizerErrorsTest, GradScaleStepAndCount) {
  for (float scale : {kNan, kInf, -kInf}) {
    OptimizerProblem p = problem_;
    p.grad_scale = scale;
    ExpectRefused(p, "grad_scale");
  }
  for (int64_t step : {0, -3}) {
    OptimizerProblem p = problem_;
    p.step = step;
    ExpectRefused(p, "step");
  }
  for (int64_t count : {0, -1}) {
    OptimizerProblem p = problem_;
    p.count = count;
    ExpectRefused(p, "count");
  }
}

TEST_F(OptimizerErrorsTest, MissingBuffersNameTheBuffer) {
  const OptimizerTensors good = tensors_;
  struct Missing {
    OptimizerOptions options;
    DType dtype;
    float* OptimizerTensors::*field;
    const char* name;
  };
  const std::vector<Missing> cases = {
      {AdamWOptions{}, DType::kBF16, &OptimizerTensors::master, "master"},
      {AdamWOptions{}, DType::kFP16, &OptimizerTensors::master, "master"},
      {AdamWOptions{}, DType::kBF16, &OptimizerTensors::grad, "grad"},
      {AdamWOptions{}, DType::kBF16, &OptimizerTensors::exp_avg, "exp_avg"},
      {AdamWOptions{}, DType::kBF16, &OptimizerTensors::exp_avg_sq, "exp_avg_sq"},
      {LionOptions{}, DType::kBF16, &OptimizerTensors::exp_avg, "exp_avg"},
      {SgdOptions{.momentum = 0.9f}, DType::kBF16, &OptimizerTensors::momentum_buffer,
       "momentum_buffer"},
  };
  for (const Missing& m : cases) {
    SCOPED_TRACE(m.name);
    tensors_ = good;
    tensors_.*m.field = nullptr;
    OptimizerProblem p = With(m.options);
    p.dtype = m.dtype;
    ExpectInvalid(Step(p), m.name);
  }
  tensors_ = good;
  tensors_.weight = nullptr;
  EXPECT_EQ(Step(problem_).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(OptimizerErrorsTest, MasterWithFp32WeightsIsRefused) {
  OptimizerProblem p = problem_;
  p.dtype = DType::kFP32;
  std::vector<float> weight(kCount, kPoison);
  tensors_.weight = weight.data();
  ExpectInvalid(Step(p), "master");
  for (float w : weight) ASSERT_EQ(w, kPoison);
}

TEST_F(OptimizerErrorsTest, BuffersThatStateNeedsNotMayBeAnything) {
  // SGD without momentum keeps no state: absent state buffers are fine, present ones untouched.
  tensors_.exp_avg = tensors_.exp_avg_sq = tensors_.momentum_buffer = nullptr;
  grad_.assign(kCount, 1.0f);
  master_.assign(kCount, 1.0f);
  EXPECT_TRUE(backend_->OptimizerStep(With(SgdOptions{}), tensors_, *stream_).ok());
  tensors_.momentum_buffer = momentum_.data();
  EXPECT_TRUE(backend_->OptimizerStep(With(SgdOptions{}), tensors_, *stream_).ok());
  for (float x : momentum_) ASSERT_EQ(x, kPoison);
}

TEST_F(OptimizerErrorsTest, OverlappingBuffersAreRefused) {
  const OptimizerTensors good = tensors_;
  tensors_.exp_avg_sq = tensors_.exp_avg;
  ExpectInvalid(Step(problem_), "exp_avg and exp_avg_sq");
  tensors_ = good;
  tensors_.grad = tensors_.master + kCount - 1;  // one element shared
  ExpectInvalid(Step(problem_), "master and grad");
  tensors_ = good;
  tensors_.weight = reinterpret_cast<char*>(master_.data()) + 2;
  ExpectInvalid(Step(problem_), "weight and master");
}

TEST_F(OptimizerErrorsTest, SquaredNormRefusesBadArguments) {
  double result = -1.0;
  const float x = 1.0f;
  EXPECT_EQ(backend_->SquaredNorm(&x, -1, &result, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->SquaredNorm(&x, 1, nullptr, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->SquaredNorm(nullptr, 1, &result, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result, -1.0);
}

}  // namespace
}  // namespace losshead::kernels
