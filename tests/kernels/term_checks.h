// The elementwise comparisons of the loss terms' suites (CPU, shards, CUDA): a vector within a
// relative tolerance plus an absolute one of another, reported as the worst error's share of its
// tolerance.
#ifndef LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_
#define LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_

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

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_TERM_CHECKS_H_
