// LaunchLogitsGemmSm90 (kernels/cuda/logits_gemm_sm90.cuh), the logits GEMM of our own for
// Hopper, against float64 on the host: fresh random H and W, shapes with partial tiles on every
// edge (rows, width, a padded row stride, K below one slice), the columns past the width
// untouched, the same logits with and without the statistics, the statistics against the logits
// as stored; and the refusals, which need no GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/logits_gemm_sm90.cuh"
#include "tests/cuda/cuda_testing.h"

namespace losshead::kernels::cuda {
namespace {

using ::losshead::kernels::testing::ToDevice;
using ::losshead::kernels::testing::ToHost;

struct Shape {
  int64_t rows, v, d, ldl;
};

class LogitsGemmSm90Test : public ::testing::TestWithParam<Shape> {};

std::vector<__nv_bfloat16> RandomBf16(int64_t count, float scale, absl::BitGen& gen) {
  std::vector<__nv_bfloat16> out(count);
  for (auto& x : out) x = __float2bfloat16(absl::Uniform(gen, -scale, scale));
  return out;
}

TEST_P(LogitsGemmSm90Test, MatchesFloat64AndGivesTheRowsStatistics) {
  SKIP_WITHOUT_GPU();
  if (!LogitsGemmSm90Runs(0)) GTEST_SKIP() << "device 0 is not compute capability 9.0";
  const Shape s = GetParam();
  absl::BitGen gen;
  const std::vector<__nv_bfloat16> h = RandomBf16(s.rows * s.d, 1.0f, gen);
  const std::vector<__nv_bfloat16> w =
      RandomBf16(s.v * s.d, 4.0f / std::sqrt(static_cast<float>(s.d)), gen);
  const int64_t tiles = LogitsTileCount(s.v);
  __nv_bfloat16* dh = ToDevice(h);
  __nv_bfloat16* dw = ToDevice(w);
  __nv_bfloat16 *plain = nullptr, *with_stats = nullptr;
  float* stats = nullptr;
  ASSERT_EQ(cudaMalloc(&plain, s.rows * s.ldl * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&with_stats, s.rows * s.ldl * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&stats, s.rows * tiles * sizeof(float)), cudaSuccess);
  // A sentinel in every byte of the logits (0x7f7f, a large finite bf16), NaN in the statistics.
  ASSERT_EQ(cudaMemset(plain, 0x7f, s.rows * s.ldl * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(with_stats, 0x7f, s.rows * s.ldl * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(stats, 0xff, s.rows * tiles * sizeof(float)), cudaSuccess);
  ASSERT_TRUE(LaunchLogitsGemmSm90(dh, dw, s.rows, s.v, s.d, plain, s.ldl, nullptr, nullptr).ok());
  ASSERT_TRUE(
      LaunchLogitsGemmSm90(dh, dw, s.rows, s.v, s.d, with_stats, s.ldl, stats, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<__nv_bfloat16> got = ToHost(plain, s.rows * s.ldl);
  const std::vector<__nv_bfloat16> got_stats = ToHost(with_stats, s.rows * s.ldl);
  const std::vector<float> st = ToHost(stats, s.rows * tiles);

  // The same bits with and without the statistics, the sentinel kept past the width.
  EXPECT_EQ(std::memcmp(got.data(), got_stats.data(), got.size() * 2), 0);
  int64_t far = 0, touched = 0, stats_off = 0;
  for (int64_t i = 0; i < s.rows; ++i) {
    for (int64_t j = 0; j < s.ldl; ++j) {
      uint16_t bits;
      std::memcpy(&bits, &got[i * s.ldl + j], 2);
      if (j >= s.v) {
        touched += bits != 0x7f7f;
        continue;
      }
      // fp32 sums of bf16 products, rounded once to bf16: half a bf16 step of the value, and the
      // sums' own rounding, bounded by the sum of |products|.
      double ref = 0.0, magnitude = 0.0;
      for (int64_t k = 0; k < s.d; ++k) {
        const double p = static_cast<double>(__bfloat162float(h[i * s.d + k])) *
                         __bfloat162float(w[j * s.d + k]);
        ref += p;
        magnitude += std::fabs(p);
      }
      const double x = __bfloat162float(got[i * s.ldl + j]);
      if (!(std::fabs(x - ref) <= std::ldexp(std::fabs(ref), -8) + 1e-4 * magnitude)) {
        if (far++ < 5) ADD_FAILURE() << "logit (" << i << ", " << j << ") " << x << " vs " << ref;
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      double largest = -INFINITY;
      const int64_t end = std::min(s.v, (t + 1) * kLogitsStatsColumns);
      for (int64_t j = t * kLogitsStatsColumns; j < end; ++j) {
        largest = std::max<double>(largest, __bfloat162float(got[i * s.ldl + j]));
      }
      double sum = 0.0;
      for (int64_t j = t * kLogitsStatsColumns; j < end; ++j) {
        sum += std::exp(__bfloat162float(got[i * s.ldl + j]) - largest);
      }
      // fp32's largest plus the log of a sum of 256 fp32 exps: a few ulps of either.
      const double lse = largest + std::log(sum);
      if (!(std::fabs(st[i * tiles + t] - lse) <= 4e-6 * std::max(1.0, std::fabs(lse)))) {
        if (stats_off++ < 5) {
          ADD_FAILURE() << "row " << i << " tile " << t << ": " << st[i * tiles + t] << " vs "
                        << lse;
        }
      }
    }
  }
  EXPECT_EQ(far, 0);
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(stats_off, 0);
  for (void* p : {static_cast<void*>(dh), static_cast<void*>(dw), static_cast<void*>(plain),
                  static_cast<void*>(with_stats), static_cast<void*>(stats)}) {
    cudaFree(p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LogitsGemmSm90Test,
    ::testing::Values(Shape{300, 1000, 520, 1000},   // partial row and column tiles, K % 64 != 0
                      Shape{1, 8, 8, 8},             // one row, K below one slice
                      Shape{200, 2056, 1024, 2064},  // many k slices, a padded row stride
                      Shape{640, 512, 128, 512}),    // more tiles than blocks on small SM counts
    [](const ::testing::TestParamInfo<Shape>& info) {
      const Shape& s = info.param;
      return absl::StrCat("rows", s.rows, "_v", s.v, "_d", s.d, "_ldl", s.ldl);
    });

// The refusals come before anything touches a device: they run without a GPU.
TEST(LogitsGemmSm90Refusals, SizesStridesAndAlignment) {
  alignas(16) static __nv_bfloat16 buffer[64];
  const __nv_bfloat16* h = buffer;
  const __nv_bfloat16* w = buffer;
  __nv_bfloat16* out = buffer;
  auto code = [&](const __nv_bfloat16* hh, int64_t rows, int64_t v, int64_t d, __nv_bfloat16* o,
                  int64_t ldl) {
    return LaunchLogitsGemmSm90(hh, w, rows, v, d, o, ldl, nullptr, nullptr).code();
  };
  EXPECT_EQ(code(h, 0, 8, 8, out, 8), absl::StatusCode::kInvalidArgument);      // no rows
  EXPECT_EQ(code(h, 4, 0, 8, out, 8), absl::StatusCode::kInvalidArgument);      // no width
  EXPECT_EQ(code(h, 4, 12, 8, out, 16), absl::StatusCode::kInvalidArgument);    // v % 8
  EXPECT_EQ(code(h, 4, 8, 12, out, 8), absl::StatusCode::kInvalidArgument);     // d % 8
  EXPECT_EQ(code(h, 4, 8, 8, out, 12), absl::StatusCode::kInvalidArgument);     // ldl % 8
  EXPECT_EQ(code(h, 4, 16, 8, out, 8), absl::StatusCode::kInvalidArgument);     // ldl < v
  EXPECT_EQ(code(h + 1, 4, 8, 8, out, 8), absl::StatusCode::kInvalidArgument);  // H unaligned
  EXPECT_EQ(code(h, 4, 8, 8, out + 1, 8), absl::StatusCode::kInvalidArgument);  // logits
  EXPECT_EQ(code(h, 4, int64_t{1} << 31, 8, out, int64_t{1} << 31),
            absl::StatusCode::kInvalidArgument);  // past the kernel's int indices
}

}  // namespace
}  // namespace losshead::kernels::cuda
