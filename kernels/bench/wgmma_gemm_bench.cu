// losshead_wgmma_bench: the logits GEMM of our own for Hopper (kernels/cuda/logits_gemm_sm90.cuh:
// bulk tensor copies and wgmma, each row's softmax statistics per 256 columns on request) against
// cuBLASLt's plan for the same GEMM (head_gemms.h's LogitsGemm), and against one read of the
// logits computing the same statistics: the read the statistics would save the row kernel.
//
// C (M x N, row-major, bf16) = A (M x K, row-major) . B (N x K, row-major)^T, bf16 inputs, fp32
// sums: the logits GEMM with A = H (tokens x D) and B = W (V x D). Each shape is checked first
// (outputs poisoned with NaN): C against cuBLASLt's (relative L2 difference, the count of
// elements whose bits differ) with and without the statistics, the statistics against the
// read's (largest values exactly, sums within 1e-5); then the four are timed in rounds
// (RoundsMedianMs, median of --runs). Needs a Hopper GPU; N and K multiples of 8.
// docs/benchmarks/kernels.md, "Our own GEMM", has the runs and the variants tried before.
//
//   losshead_wgmma_bench --shapes=4096:128256:4096,8192:8192:8192,1000:1032:520 --runs=20
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/bench/tensor_diff.cuh"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/logits_gemm_sm90.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/reduce.cuh"

namespace losshead::bench {
namespace {

using kernels::cuda::kLogitsStatsColumns;
constexpr int kColumns = static_cast<int>(kLogitsStatsColumns);

// The same statistics by one read of C (M x n, row-major): a block per row, a warp per tile of
// 256 columns at a time, 16 bytes per lane, reduced as the GEMM's are (reduce.cuh's
// WarpTileLse). What the GEMM's are checked against, and the read of the logits they would
// save a row kernel (timed beside the GEMMs).
__global__ void __launch_bounds__(256)
    ReadRowTileStats(const __nv_bfloat16* c, int n, int tiles_n, float* stats) {
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* x = c + static_cast<int64_t>(row) * n;
  for (int tile = warp; tile < tiles_n; tile += 8) {
    const int col = tile * kColumns + lane * 8;
    float v[8];
    if (col + 8 <= n) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + col);
      const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = col + i < n ? __bfloat162float(x[col + i]) : -INFINITY;
    }
    const float tile_lse = kernels::cuda::WarpTileLse(v);
    if (lane == 0) stats[static_cast<int64_t>(row) * tiles_n + tile] = tile_lse;
  }
}

// Largest |a - b| over `count` floats into *out (zeroed first; non-negative floats compare as
// their bits); +inf where a value of `a` is NaN (never written).
__global__ void StatsDiff(const float* a, const float* b, int64_t count, float* out) {
  float largest = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    largest = a[i] != a[i] ? INFINITY : fmaxf(largest, fabsf(a[i] - b[i]));
  }
  atomicMax(reinterpret_cast<unsigned*>(out), __float_as_uint(largest));
}

struct Shape {
  int64_t m, n, k;
};

int Main(int argc, char** argv) {
  std::vector<Shape> shapes = {{4096, 128256, 4096}, {8192, 8192, 8192}, {1000, 1032, 520}};
  int runs = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--runs=", 0) == 0) runs = std::max(1, std::atoi(a.c_str() + 7));
    if (a.rfind("--shapes=", 0) == 0) {
      shapes.clear();
      for (size_t start = 9; start < a.size();) {
        size_t end = a.find(',', start);
        if (end == std::string::npos) end = a.size();
        long long m = 0, n = 0, k = 0;
        if (std::sscanf(a.substr(start, end - start).c_str(), "%lld:%lld:%lld", &m, &n, &k) != 3 ||
            m < 1 || n < 8 || k < 8 || n % 8 != 0 || k % 8 != 0) {
          std::fprintf(stderr, "--shapes=M:N:K,... with N and K multiples of 8\n");
          return 1;
        }
        shapes.push_back({m, n, k});
        start = end + 1;
      }
    }
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (!kernels::cuda::LogitsGemmSm90Runs(0)) {
    std::fprintf(stderr, "needs a Hopper GPU (sm_90a); this is sm_%d%d\n", prop.major, prop.minor);
    return 1;
  }
  std::printf(
      "device: %s, %d SMs; C = A . B^T in bf16, fp32 sums; ours without and with the row "
      "statistics per %d columns, cuBLASLt, and one read of C for the same statistics, timed in "
      "rounds, median of %d\n",
      prop.name, prop.multiProcessorCount, kColumns, runs);
  std::printf(
      "| M | N | K | ours ms | TFLOP/s | ours + stats ms | cuBLASLt ms | TFLOP/s | cuBLASLt / ours "
      "| cuBLASLt / ours + stats | the read ms | rel. diff ours / + stats | bits differ ours / + "
      "stats | stats: max abs diff of the tiles' lse |\n");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<kernels::cuda::LtGemm> lt;
  BENCH_OK(kernels::cuda::LtGemm::Create(&lt));
  constexpr size_t kWorkspace = size_t{4} << 20;
  void* workspace = nullptr;
  BENCH_CUDA(cudaMalloc(&workspace, kWorkspace));
  bool all_close = true;
  for (const Shape& s : shapes) {
    const int64_t tiles_n = kernels::cuda::LogitsTileCount(s.n);
    __nv_bfloat16 *a, *b, *ours, *theirs;
    float *stats, *read_stats;  // the GEMM's and the read's
    float* stats_diff;
    BENCH_CUDA(cudaMalloc(&a, s.m * s.k * 2));
    BENCH_CUDA(cudaMalloc(&b, s.n * s.k * 2));
    BENCH_CUDA(cudaMalloc(&ours, s.m * s.n * 2));
    BENCH_CUDA(cudaMalloc(&theirs, s.m * s.n * 2));
    BENCH_CUDA(cudaMalloc(&stats, s.m * tiles_n * sizeof(float)));
    BENCH_CUDA(cudaMalloc(&read_stats, s.m * tiles_n * sizeof(float)));
    BENCH_CUDA(cudaMalloc(&stats_diff, sizeof(float)));
    // As kernel_bench's: h ~ U(-1, 1), w ~ U(-4 / sqrt(K), 4 / sqrt(K)).
    BENCH_CUDA(FillUniformBf16(a, s.m * s.k, 1.0f, 11, stream));
    BENCH_CUDA(FillUniformBf16(b, s.n * s.k, 4.0f / std::sqrt(float(s.k)), 12, stream));
    static constexpr float kOne = 1.0f, kZero = 0.0f;
    // The fused call's logits GEMM: logits (tokens x width) = H . W^T with H = A, W = B.
    const kernels::cuda::GemmShape shape =
        kernels::cuda::LogitsGemm(s.n, s.m, s.k, CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_16BF, s.n);
    auto run_ours = [&] {
      BENCH_OK(
          kernels::cuda::LaunchLogitsGemmSm90(a, b, s.m, s.n, s.k, ours, s.n, nullptr, stream));
    };
    auto run_stats = [&] {
      BENCH_OK(kernels::cuda::LaunchLogitsGemmSm90(a, b, s.m, s.n, s.k, ours, s.n, stats, stream));
    };
    auto run_theirs = [&] {
      BENCH_OK(lt->Run(shape, &kOne, b, a, &kZero, theirs, workspace, kWorkspace, stream));
    };
    auto run_read = [&] {
      ReadRowTileStats<<<static_cast<unsigned>(s.m), 256, 0, stream>>>(
          theirs, static_cast<int>(s.n), static_cast<int>(tiles_n), read_stats);
      BENCH_CUDA(cudaGetLastError());
    };
    BENCH_CUDA(cudaMemsetAsync(ours, 0xff, s.m * s.n * 2, stream));  // NaN where unwritten
    run_ours();
    run_theirs();
    run_read();
    TensorDiff diff, diff_stats;
    BENCH_CUDA(DiffTensors(ours, theirs, s.m * s.n, /*fp32=*/false, stream, &diff));
    BENCH_CUDA(cudaMemsetAsync(ours, 0xff, s.m * s.n * 2, stream));
    BENCH_CUDA(cudaMemsetAsync(stats, 0xff, s.m * tiles_n * sizeof(float), stream));
    run_stats();
    BENCH_CUDA(DiffTensors(ours, theirs, s.m * s.n, /*fp32=*/false, stream, &diff_stats));
    BENCH_CUDA(cudaMemsetAsync(stats_diff, 0, sizeof(float), stream));
    StatsDiff<<<264, 256, 0, stream>>>(stats, read_stats, s.m * tiles_n, stats_diff);
    float stats_error = 0.0f;
    BENCH_CUDA(
        cudaMemcpyAsync(&stats_error, stats_diff, sizeof(float), cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    // bf16 outputs: a rounding step is 2^-8. The statistics: the same values summed the same way.
    const bool close = diff.relative <= 1e-2 && diff_stats.relative <= 1e-2 && stats_error == 0.0f;
    all_close &= close;
    const std::vector<float> ms =
        RoundsMedianMs(stream, 2, runs, {run_ours, run_stats, run_theirs, run_read});
    const double flop = 2.0 * s.m * s.n * s.k;
    std::printf(
        "| %lld | %lld | %lld | %.3f | %.1f | %.3f | %.3f | %.1f | %.3f | %.3f | %.3f | %.1e / "
        "%.1e | %lld / %lld | %.1e%s |\n",
        (long long)s.m, (long long)s.n, (long long)s.k, ms[0], flop / ms[0] / 1e9, ms[1], ms[2],
        flop / ms[2] / 1e9, ms[2] / ms[0], ms[2] / ms[1], ms[3], diff.relative, diff_stats.relative,
        (long long)diff.differing, (long long)diff_stats.differing, stats_error,
        close ? "" : " FAIL");
    std::fflush(stdout);
    for (void* p : {(void*)a, (void*)b, (void*)ours, (void*)theirs, (void*)stats, (void*)read_stats,
                    (void*)stats_diff}) {
      cudaFree(p);
    }
  }
  cudaFree(workspace);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return all_close ? 0 : 2;
}

}  // namespace
}  // namespace losshead::bench

int main(int argc, char** argv) { return losshead::bench::Main(argc, argv); }
