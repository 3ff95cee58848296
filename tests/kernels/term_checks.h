// The elementwise comparisons of the loss terms' suites (CPU, shards, CUDA): a vector within a
// relative tolerance plus an absolute one of another, reported as the worst error's share of its
// tolerance.
#ifndef LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_
#define LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/backend_runner.h"

namespace losshead::kernels::testing {

// |got_i - want_i| <= rel |want_i| + abs for every i (and the sizes equal).
inline void ExpectWithin(const std::vector<double>& got, const std::vector<double>& want,
                         double rel, double abs, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double worst = WorstToleranceRatio(got, want, rel, abs);
  EXPECT_LE(worst, 1.0) << what << ": worst error " << worst << " of the tolerance";
}

// The same with the absolute tolerance a share of the largest |want_i|.
inline void ExpectWithinShare(const std::vector<double>& got, const std::vector<double>& want,
                              double rel, double abs_share, const std::string& what) {
  ExpectWithin(got, want, rel, abs_share * MaxAbs(want), what);
}

// The unit roundoff of a problem's dtype: what its rounded dH and G err by, relatively.
inline double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 0x1p-8;
    case DType::kFP16:
      return 0x1p-11;
    case DType::kFP32:
      return 0x1p-24;
  }
  return 0.0;
}

// The CUDA term suites' tolerances against the CPU backend (one device and shards; the reasons
// are in tests/cuda/cuda_loss_terms_test.cc): values relative plus a share of the largest, and
// the gradients the same, with bf16 logits (every z rounded before the row reads it) wider.
struct TermTolerance {
  double value_rel, value_abs;  // abs: a share of the largest value
  double grad_rel, grad_abs;
};

inline TermTolerance CudaTermTolerance(DType dtype, bool bf16_logits) {
  if (bf16_logits && dtype == DType::kBF16) return {3e-2, 3e-2, 2e-2, 2e-2};
  const double grad_abs = dtype == DType::kFP32 ? 1e-4 : 2e-3;
  return {1e-3, 1e-4, std::max(4 * UnitRoundoff(dtype), 1e-5), grad_abs};
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_
