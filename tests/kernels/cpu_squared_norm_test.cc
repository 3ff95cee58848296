// The CPU backend's squared gradient norm: accurate against a long-double sum, and the same bits
// for every thread count, alignment and rerun.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/optimizer_runner.h"

namespace losshead::kernels {
namespace {

using testing::DoubleBits;
using testing::RandomGradient;

double NormOn(Backend& backend, const std::vector<float>& g, int64_t offset = 0) {
  absl::StatusOr<double> norm = testing::SquaredNormOn(backend, g, offset);
  EXPECT_TRUE(norm.ok()) << norm.status();
  return norm.value_or(-1.0);
}

TEST(CpuSquaredNormTest, Fp32_1000003_MatchesLongDoubleSum) {
  const std::vector<float> g = RandomGradient(1000003, 5);
  long double want = 0.0L;
  for (float x : g) want += static_cast<long double>(x) * x;
  const double got = NormOn(*CreateCpuBackend(2), g);
  EXPECT_NEAR(got, static_cast<double>(want), 1e-13 * static_cast<double>(want));
}

TEST(CpuSquaredNormTest, Fp32_1000003_SameBitsForEveryThreadCountAlignmentAndRerun) {
  const std::vector<float> g = RandomGradient(1000003, 6);
  const uint64_t first = DoubleBits(NormOn(*CreateCpuBackend(1), g));
  for (int threads : {1, 2, 3, 8}) {
    SCOPED_TRACE(threads);
    std::unique_ptr<Backend> backend = CreateCpuBackend(threads);
    EXPECT_EQ(DoubleBits(NormOn(*backend, g)), first);
    EXPECT_EQ(DoubleBits(NormOn(*backend, g)), first);
    EXPECT_EQ(DoubleBits(NormOn(*backend, g, /*offset=*/1)), first);
  }
}

TEST(CpuSquaredNormTest, SmallCountsAndEmpty) {
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  EXPECT_EQ(NormOn(*backend, {1.0f, -2.0f, 0.5f}), 5.25);
  EXPECT_EQ(NormOn(*backend, {}), 0.0);
  std::unique_ptr<Stream> stream = *backend->CreateStream();
  double result = -1.0;
  ASSERT_TRUE(backend->SquaredNorm(nullptr, 0, &result, *stream).ok());
  EXPECT_EQ(result, 0.0);
}

TEST(CpuSquaredNormTest, NonFiniteElementGivesNonFiniteNorm) {
  std::vector<float> g = RandomGradient(70001, 8);
  std::unique_ptr<Backend> backend = CreateCpuBackend(2);
  g[70000] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(NormOn(*backend, g)));
  g[70000] = 0.0f;
  g[12] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(NormOn(*backend, g)));
}

}  // namespace
}  // namespace losshead::kernels
