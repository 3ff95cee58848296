// The bounds of step_bound.h hold: on random problems (shapes, options, magnitudes of H and W
// over many orders), every logit, the loss, dH and dW of the float64 reference are within them;
// and CheckStepBounds refuses exactly what would overflow, with OUT_OF_RANGE.
#include "losshead/kernels/step_bound.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/common/loss_math.h"
#include "losshead/kernels/problem.h"
#include "tests/kernels/reference_loss.h"

namespace losshead::kernels {
namespace {

double MaxAbsOf(const std::vector<double>& values) {
  double m = 0;
  for (double x : values) m = std::max(m, std::fabs(x));
  return m;
}

TEST(StepBoundTest, RandomProblemsStayWithinTheirBounds) {
  std::mt19937_64 rng(2026);
  std::uniform_int_distribution<int> size(1, 24);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const Reduction reductions[] = {Reduction::kMean, Reduction::kSum, Reduction::kNone};
  for (int trial = 0; trial < 300; ++trial) {
    Problem p{.n = size(rng), .d = size(rng), .v = 2 + size(rng), .dtype = DType::kFP32};
    LossOptions& o = p.options;
    o.reduction = reductions[rng() % 3];
    o.grad_scale = static_cast<float>(std::ldexp(unit(rng) - 0.5, static_cast<int>(rng() % 20)));
    o.label_smoothing = rng() % 2 ? static_cast<float>(unit(rng) * 0.9) : 0.0f;
    o.z_loss = rng() % 2 ? static_cast<float>(unit(rng)) : 0.0f;
    o.softcap = rng() % 3 == 0 ? static_cast<float>(1.0 + 30 * unit(rng)) : 0.0f;
    // Magnitudes from 2^-8 to 2^8: large enough for peaked softmaxes, small enough for exp.
    const double h_scale = std::ldexp(1.0, static_cast<int>(rng() % 9) - 6);
    const double w_scale = std::ldexp(1.0, static_cast<int>(rng() % 9) - 6);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> h(static_cast<size_t>(p.n * p.d));
    std::vector<double> w(static_cast<size_t>(p.v * p.d));
    for (double& x : h) x = h_scale * normal(rng);
    for (double& x : w) x = w_scale * normal(rng);
    std::vector<int32_t> y(static_cast<size_t>(p.n));
    for (int32_t& t : y) t = rng() % 4 == 0 ? -100 : static_cast<int32_t>(rng() % p.v);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": n " << p.n << " d " << p.d
                                      << " v " << p.v << " grad_scale " << o.grad_scale
                                      << " z_loss " << o.z_loss << " softcap " << o.softcap);

    const testing::ReferenceResult r = testing::ReferenceLoss(p, h, w, y);
    const StepBounds b = BoundStep(p, MaxAbsOf(h), MaxAbsOf(w), r.token_count);
    double logit = 0;
    for (int64_t t = 0; t < p.n; ++t) {
      for (int64_t j = 0; j < p.v; ++j) {
        double x = 0;
        for (int64_t k = 0; k < p.d; ++k) x += h[t * p.d + k] * w[j * p.d + k];
        logit = std::max(logit, std::fabs(x));
      }
    }
    EXPECT_LE(logit, b.logit);
    EXPECT_LE(std::fabs(r.loss_sum), b.loss_sum);
    EXPECT_LE(MaxAbsOf(r.grad_hidden), b.grad_hidden);
    EXPECT_LE(MaxAbsOf(r.grad_weight), b.grad_weight);
    EXPECT_TRUE(CheckStepBounds(p, b, MaxAbsOf(h), MaxAbsOf(w), DType::kFP32, true).ok());
  }
}

TEST(StepBoundTest, RefusesWhatWouldOverflowWithOutOfRange) {
  Problem p{.n = 4, .d = 4096, .v = 128256, .dtype = DType::kBF16};
  auto check = [&](double hidden_abs, double weight_abs, DType dh = DType::kBF16,
                   bool grad_weight = true) {
    return CheckStepBounds(p, BoundStep(p, hidden_abs, weight_abs, p.n), hidden_abs, weight_abs,
                           dh, grad_weight)
        .code();
  };
  EXPECT_EQ(check(1e3, 1.0), absl::StatusCode::kOk);
  EXPECT_EQ(check(3e38, 0.02), absl::StatusCode::kOutOfRange);  // the logits
  EXPECT_EQ(check(1e33, 1.0), absl::StatusCode::kOk);
  EXPECT_EQ(check(1e35, 1.0), absl::StatusCode::kOutOfRange);
  // dH in fp16, summed: up to 2 |w|, past 65504 (with the roundings' room) above |w| = 16376.
  p.options.reduction = Reduction::kSum;
  EXPECT_EQ(check(1.0, 1e4, DType::kFP16), absl::StatusCode::kOk);
  EXPECT_EQ(check(1.0, 2e4, DType::kFP16), absl::StatusCode::kOutOfRange);
  p.options.reduction = Reduction::kMean;
  // A soft-cap bounds the loss whatever the logits, but not the logits' own GEMM.
  p.options.softcap = 30.0f;
  p.options.z_loss = 1e30f;
  EXPECT_EQ(check(1.0, 1.0), absl::StatusCode::kOk);
  p.options.z_loss = 1e36f;
  EXPECT_EQ(check(1.0, 1.0), absl::StatusCode::kOutOfRange);  // z_loss * lse^2
  p.options.z_loss = 0.0f;
  p.options.grad_scale = 3e38f;
  p.options.reduction = Reduction::kSum;
  EXPECT_EQ(check(1.0, 1.0, DType::kBF16, false), absl::StatusCode::kOutOfRange);  // scaled g
  p.options.grad_scale = 1e37f;
  EXPECT_EQ(check(4.0, 1.0, DType::kBF16, false), absl::StatusCode::kOk);
  EXPECT_EQ(check(4.0, 1.0, DType::kBF16, true), absl::StatusCode::kOutOfRange);  // 4 tokens' dW
  EXPECT_EQ(BoundStep(p, std::numeric_limits<double>::infinity(), 1.0, 1).logit,
            std::numeric_limits<double>::infinity());
}

// The clamped KL term (loss_math.h) adds kl_coef 10 to a token's loss and kl_coef (exp(d*) - 1)
// to |dloss/dlog p| whatever the logits: without a soft-cap, logits bounded by some 4e6 (where
// k3 itself would be e^(8e6)) are accepted, and only the term's own coefficient can overflow.
TEST(StepBoundTest, ClampedKlTermIsBoundedWhateverTheLogits) {
  // d* solves exp(d) - d - 1 = 10 to the last bits, and is where the slope bound comes from.
  const double root = loss::KlClampRoot();
  EXPECT_NEAR(root, 2.61087, 1e-5);
  EXPECT_NEAR(std::exp(root) - root - 1.0 - loss::kKlClamp, 0.0, 1e-13);
  EXPECT_EQ(KlSlopeBound(), std::exp(root) - 1.0);
  EXPECT_NEAR(KlSlopeBound(), 12.61087, 1e-5);

  Problem p{.n = 8, .d = 4096, .v = 128256, .dtype = DType::kBF16};
  p.options.kind = LossKind::kPolicyGradient;
  const TermInputBounds terms{.advantage_abs = 2.0, .old_logprob_neg = 0.5};
  auto bounds = [&](float kl_coef, double hidden_abs) {
    p.options.kl_coef = kl_coef;
    return BoundStep(p, hidden_abs, 1.0, p.n, terms);
  };
  const StepBounds without = bounds(0.0f, 1e3);
  const StepBounds with = bounds(0.5f, 1e3);
  EXPECT_NEAR(with.loss_sum - without.loss_sum, p.n * 0.5 * loss::kKlClamp, 1e-9 * with.loss_sum);
  EXPECT_NEAR(with.grad - without.grad, 2.0 * 0.5 * KlSlopeBound(), 1e-12 * with.grad);
  // Independent of the logits' bound: the same addition at 1e3 and at 1e1.
  const StepBounds small = bounds(0.5f, 10.0);
  EXPECT_NEAR(small.grad - bounds(0.0f, 10.0).grad, with.grad - without.grad, 1e-12 * with.grad);
  EXPECT_EQ(CheckStepBounds(p, with, 1e3, 1.0, DType::kBF16, true).code(),
            absl::StatusCode::kOk);
  // Only a coefficient that itself overflows the gradient is refused.
  const StepBounds huge = bounds(1e38f, 1e3);
  EXPECT_EQ(CheckStepBounds(p, huge, 1e3, 1.0, DType::kBF16, true).code(),
            absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace losshead::kernels
