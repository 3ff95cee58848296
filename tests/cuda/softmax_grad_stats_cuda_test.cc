// The row kernel fed the logits GEMM's statistics per tile (SoftmaxGradParams::tile_stats)
// instead of its own first read: on logits that LaunchLogitsGemmSm90 wrote (a width with a tail
// of columns it leaves to others, written here from the host), the lse, the loss and the gradient
// against float64 of the logits as stored, and against the same kernel without the statistics;
// ignored rows and targets in the tail; with the distribution outputs asked for, the same bits of
// the lse, the loss and the gradient; the refusals, which need no GPU.
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
#include "kernels/cuda/softmax_grad.cuh"
#include "tests/cuda/cuda_testing.h"

namespace losshead::kernels::cuda {
namespace {

using ::losshead::kernels::testing::ToDevice;
using ::losshead::kernels::testing::ToHost;

struct StatsCase {
  int64_t rows, v, d;
  float z_loss;
};

class SoftmaxGradStatsTest : public ::testing::TestWithParam<StatsCase> {};

// One launch's per-row lse and loss, and its gradient (bf16, beside the logits).
struct RowResults {
  std::vector<float> lse, loss;
  std::vector<__nv_bfloat16> grad;
};

RowResults RunRows(const __nv_bfloat16* logits, int64_t ldl, const int32_t* targets,
                   const SoftmaxGradParams& params, int64_t rows, const RowOutputs& outputs = {}) {
  float *row_loss = nullptr, *lse = nullptr;
  __nv_bfloat16* grad = nullptr;
  EXPECT_EQ(cudaMalloc(&row_loss, rows * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&lse, rows * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&grad, rows * ldl * 2), cudaSuccess);
  EXPECT_EQ(cudaMemset(lse, 0xff, rows * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemset(grad, 0xff, rows * ldl * 2), cudaSuccess);
  const absl::Status s = LaunchSoftmaxGrad<__nv_bfloat16, __nv_bfloat16>(
      logits, ldl, rows, targets, params, grad, ldl, row_loss, nullptr, lse, RowLaunch{}, nullptr,
      outputs);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  RowResults r{ToHost(lse, rows), ToHost(row_loss, rows), ToHost(grad, rows * ldl)};
  cudaFree(row_loss);
  cudaFree(lse);
  cudaFree(grad);
  return r;
}

TEST_P(SoftmaxGradStatsTest, MatchesFloat64AndTheTwoPassKernel) {
  SKIP_WITHOUT_GPU();
  if (!LogitsGemmSm90Runs(0)) GTEST_SKIP() << "device 0 is not compute capability 9.0";
  const StatsCase c = GetParam();
  const int64_t bulk = c.v / 8 * 8;
  const int64_t ldl = (c.v + 15) / 16 * 16;
  const int64_t tiles = LogitsTileCount(bulk);
  absl::BitGen gen;
  std::vector<__nv_bfloat16> h(c.rows * c.d), w(bulk * c.d);
  for (auto& x : h) x = __float2bfloat16(absl::Gaussian(gen, 0.0f, 1.0f));
  const float w_std = 3.0f / std::sqrt(static_cast<float>(c.d));
  for (auto& x : w) x = __float2bfloat16(absl::Gaussian(gen, 0.0f, w_std));
  // Targets anywhere in the width, the tail included; about one row in ten ignored.
  std::vector<int32_t> targets(c.rows);
  for (int64_t i = 0; i < c.rows; ++i) {
    targets[i] = absl::Bernoulli(gen, 0.1) ? -100
                 : i % 7 == 0 && bulk < c.v
                     ? static_cast<int32_t>(absl::Uniform<int64_t>(gen, bulk, c.v))
                     : static_cast<int32_t>(absl::Uniform<int64_t>(gen, 0, c.v));
  }
  __nv_bfloat16* dh = ToDevice(h);
  __nv_bfloat16* dw = ToDevice(w);
  int32_t* dt = ToDevice(targets);
  __nv_bfloat16* logits = nullptr;
  float* stats = nullptr;
  ASSERT_EQ(cudaMalloc(&logits, c.rows * ldl * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&stats, c.rows * tiles * sizeof(float)), cudaSuccess);
  ASSERT_TRUE(LaunchLogitsGemmSm90(dh, dw, c.rows, bulk, c.d, logits, ldl, stats, nullptr).ok());
  // The tail's columns, which the fused call's tail kernel writes: random logits from here.
  if (bulk < c.v) {
    std::vector<__nv_bfloat16> tail(c.rows * (c.v - bulk));
    for (auto& x : tail) x = __float2bfloat16(absl::Gaussian(gen, 0.0f, 3.0f));
    ASSERT_EQ(cudaMemcpy2D(logits + bulk, ldl * 2, tail.data(), (c.v - bulk) * 2, (c.v - bulk) * 2,
                           c.rows, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<__nv_bfloat16> x = ToHost(logits, c.rows * ldl);

  SoftmaxGradParams two_pass;
  two_pass.v = c.v;
  two_pass.loss.z_loss = c.z_loss;
  SoftmaxGradParams from_stats = two_pass;
  from_stats.tile_stats = stats;
  from_stats.stats_width = bulk;
  from_stats.stats_ld = tiles;
  const RowResults a = RunRows(logits, ldl, dt, from_stats, c.rows);
  const RowResults b = RunRows(logits, ldl, dt, two_pass, c.rows);
  // The distribution outputs' kernel (the top-k's, which carries the others' statistics too).
  float *logprob = nullptr, *entropy = nullptr, *top_logprobs = nullptr;
  int32_t* top_ids = nullptr;
  constexpr int kTopK = 4;
  ASSERT_EQ(cudaMalloc(&logprob, c.rows * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&entropy, c.rows * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&top_logprobs, c.rows * kTopK * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&top_ids, c.rows * kTopK * sizeof(int32_t)), cudaSuccess);
  RowOutputs outputs;
  outputs.logprob = logprob;
  outputs.entropy = entropy;
  outputs.top_k = kTopK;
  outputs.top_k_ids = top_ids;
  outputs.top_k_logprobs = top_logprobs;
  const RowResults with_outputs = RunRows(logits, ldl, dt, from_stats, c.rows, outputs);
  const std::vector<float> got_logprob = ToHost(logprob, c.rows);
  const std::vector<float> got_top = ToHost(top_logprobs, c.rows * kTopK);
  const std::vector<int32_t> got_ids = ToHost(top_ids, c.rows * kTopK);
  EXPECT_EQ(std::memcmp(with_outputs.lse.data(), a.lse.data(), c.rows * 4), 0);
  EXPECT_EQ(std::memcmp(with_outputs.loss.data(), a.loss.data(), c.rows * 4), 0);
  EXPECT_EQ(std::memcmp(with_outputs.grad.data(), a.grad.data(), c.rows * ldl * 2), 0);

  int64_t off = 0;
  auto expect_near = [&](double got, double want, double tol, const char* what, int64_t i,
                         int64_t j) {
    if (!(std::fabs(got - want) <= tol) && off++ < 8) {
      ADD_FAILURE() << what << " row " << i << " col " << j << ": " << got << " vs " << want;
    }
  };
  for (int64_t i = 0; i < c.rows; ++i) {
    const __nv_bfloat16* row = &x[i * ldl];
    double m = -INFINITY, s = 0.0;
    for (int64_t j = 0; j < c.v; ++j) m = std::max<double>(m, __bfloat162float(row[j]));
    for (int64_t j = 0; j < c.v; ++j) s += std::exp(__bfloat162float(row[j]) - m);
    const double lse = m + std::log(s);
    const bool counted = targets[i] != -100;
    const double loss =
        counted ? lse - __bfloat162float(row[targets[i]]) + c.z_loss * lse * lse : 0.0;
    expect_near(a.lse[i], lse, 2e-6 * std::max(1.0, std::fabs(lse)), "lse", i, -1);
    expect_near(a.loss[i], loss, 2e-6 * std::max(1.0, std::fabs(lse)), "loss", i, -1);
    if (counted) {
      const double logprob = __bfloat162float(row[targets[i]]) - lse;
      expect_near(got_logprob[i], logprob, 2e-6 * std::max(1.0, std::fabs(lse)), "logprob", i,
                  targets[i]);
      // The best class's log-probability, against the lse of the statistics.
      const int32_t best = got_ids[i * kTopK];
      ASSERT_GE(best, 0);
      ASSERT_LT(best, c.v);
      expect_near(got_top[i * kTopK], __bfloat162float(row[best]) - lse,
                  2e-6 * std::max(1.0, std::fabs(lse)), "top-1 logprob", i, best);
    }
    // The two kernels differ only in how the exps are summed: a few ulps of the lse.
    expect_near(a.lse[i], b.lse[i], 1e-6 * std::max(1.0f, std::fabs(b.lse[i])), "lse vs 2-pass", i,
                -1);
    const double factor = 1.0 + 2.0 * c.z_loss * lse;
    for (int64_t j = 0; j < c.v; ++j) {
      const double p = std::exp(__bfloat162float(row[j]) - lse);
      const double g = counted ? p * factor - (j == targets[i] ? 1.0 : 0.0) : 0.0;
      const double got = __bfloat162float(a.grad[i * ldl + j]);
      // bf16's rounding (2^-8 of the value) and the fp32 exp's few ulps.
      expect_near(got, g, std::ldexp(std::fabs(g), -7) + 1e-7, "grad", i, j);
      const double other = __bfloat162float(b.grad[i * ldl + j]);
      expect_near(got, other, std::ldexp(std::fabs(other), -7) + 1e-7, "grad vs 2-pass", i, j);
    }
  }
  EXPECT_EQ(off, 0);
  for (void* p : {static_cast<void*>(dh), static_cast<void*>(dw), static_cast<void*>(dt),
                  static_cast<void*>(logits), static_cast<void*>(stats),
                  static_cast<void*>(logprob), static_cast<void*>(entropy),
                  static_cast<void*>(top_logprobs), static_cast<void*>(top_ids)}) {
    cudaFree(p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SoftmaxGradStatsTest,
    ::testing::Values(StatsCase{300, 4093, 256, 0.0f},   // a tail of 5 past 16 tiles
                      StatsCase{129, 1000, 520, 1e-3f},  // no tail, a partial last tile, z-loss
                      StatsCase{40, 32003, 512, 0.0f}),  // 125 tiles, a tail of 3
    [](const ::testing::TestParamInfo<StatsCase>& info) {
      const StatsCase& c = info.param;
      return absl::StrCat("rows", c.rows, "_v", c.v, "_d", c.d, c.z_loss > 0 ? "_zloss" : "");
    });

// Statistics of the logits as they are serve no loss that transforms them or needs more of the
// row, nor a width they do not fit: refused before anything runs, so without a GPU.
TEST(SoftmaxGradStatsRefusals, LossesAndShapesTheyDoNotServe) {
  alignas(16) static __nv_bfloat16 logits[64];
  alignas(16) static float stats[8];
  static int32_t targets[4];
  static float floats[4];
  SoftmaxGradParams base;
  base.v = 16;
  base.tile_stats = stats;
  base.stats_width = 16;
  base.stats_ld = 1;
  auto code = [&](const SoftmaxGradParams& p, const RowOutputs& outputs = {},
                  const RowTerms& terms = {}) {
    return LaunchSoftmaxGrad<__nv_bfloat16, __nv_bfloat16>(logits, 16, 4, targets, p, logits, 16,
                                                           floats, nullptr, nullptr, RowLaunch{},
                                                           nullptr, outputs, terms)
        .code();
  };
  SoftmaxGradParams p = base;
  p.loss.softcap = 30.0f;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
  p = base;
  p.loss.label_smoothing = 0.1f;
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
  RowTerms terms;
  terms.token_weights = floats;
  EXPECT_EQ(code(base, {}, terms), absl::StatusCode::kInvalidArgument);
  // fp32 logits: no GEMM leaves statistics of them.
  alignas(16) static float wide[64];
  EXPECT_EQ((LaunchSoftmaxGrad<float, float>(wide, 16, 4, targets, base, wide, 16, floats, nullptr,
                                             nullptr, RowLaunch{}, nullptr)
                 .code()),
            absl::StatusCode::kInvalidArgument);
  p = base;
  p.stats_width = 17;  // wider than the rows
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
  p = base;
  p.stats_width = 264;
  p.v = 264;
  p.stats_ld = 1;  // two tiles per row
  EXPECT_EQ(code(p), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::kernels::cuda
