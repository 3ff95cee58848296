#include "tests/recovery/run_comparison.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

double RelativeDeviation(const client::Bytes& got, const client::Bytes& want, v1::DType dtype) {
  const std::vector<float> g = Decode(got, dtype);
  const std::vector<float> w = Decode(want, dtype);
  if (g.size() != w.size()) return INFINITY;
  double scale = 0, worst = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(w[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(g[i]) - w[i]));
  }
  if (worst == 0) return 0;
  return scale == 0 ? INFINITY : worst / scale;
}

void RunComparison::Tensor(const client::Bytes& got, const client::Bytes& want, v1::DType dtype,
                           const std::string& what) {
  if (exact_ && got == want) return;
  const double deviation = RelativeDeviation(got, want, dtype);
  worst_ = std::max(worst_, deviation);
  if (exact_) {
    ADD_FAILURE() << what << " differs (by " << deviation << " of its largest value)";
  } else {
    EXPECT_LE(deviation, ToleranceFor(dtype).grad) << what;
  }
}

void RunComparison::Answer(const client::StepResult& got, const client::StepResult& want,
                           v1::DType dtype, const std::string& what) {
  Sum(got.loss_sum, want.loss_sum, dtype, what + ": loss");
  Tensor(got.grad_hidden, want.grad_hidden, dtype, what + ": dH");
}

void RunComparison::Sum(double got, double want, v1::DType dtype, const std::string& what) {
  if (got == want) return;
  const double deviation = std::fabs(got - want) / std::fabs(want);
  worst_ = std::max(worst_, deviation);
  if (exact_) {
    ADD_FAILURE() << what << ": " << got << " != " << want;
  } else {
    EXPECT_LE(deviation, ToleranceFor(dtype).loss_rel) << what << ": " << got << " vs " << want;
  }
}

}  // namespace losshead::testing
