#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/squared_norm.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Many more blocks than fit on the device at once, so that the last wave is a small part of the
// pass whatever the device's size.
constexpr int kBlocks = kSquaredNormPartials;
constexpr int kFinalThreads = 1024;
constexpr int kGroup = 4;  // elements per unit: one float4 when the buffer is aligned

// Sum over the block in a fixed tree (reduce.cuh): shuffles within each warp, then warp sums in
// order; valid in thread 0.
template <int kBlockThreads>
__device__ __forceinline__ double BlockSum(double x) {
  return BlockReduce<kBlockThreads>(x, SumOp{}, 0.0);
}

// Unit u (kGroup consecutive elements, added in index order) belongs to thread u % (grid size);
// each thread walks its units in increasing order. The float4 and scalar loads visit the same
// units in the same order, so alignment changes speed, never the bits.
template <bool kAligned>
__global__ void __launch_bounds__(kThreads)
    PartialsKernel(const float* __restrict__ data, int64_t count, double* __restrict__ partials) {
  const int64_t units = count / kGroup;
  const int64_t stride = static_cast<int64_t>(kBlocks) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  double acc = 0.0;
#pragma unroll 4
  for (int64_t u = first; u < units; u += stride) {
    float x[kGroup];
    if constexpr (kAligned) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(data) + u);
      x[0] = v.x;
      x[1] = v.y;
      x[2] = v.z;
      x[3] = v.w;
    } else {
#pragma unroll
      for (int k = 0; k < kGroup; ++k) x[k] = __ldcs(data + u * kGroup + k);
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      // A float's square is exact in fp64: only the additions round.
      const double d = x[k];
      acc += d * d;
    }
  }
  // The last count % kGroup elements go to the thread that would own the next unit.
  if (first == units % stride) {
    for (int64_t i = units * kGroup; i < count; ++i) {
      const double d = data[i];
      acc += d * d;
    }
  }
  const double block = BlockSum<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

__global__ void __launch_bounds__(kFinalThreads)
    FinalKernel(const double* __restrict__ partials, double* __restrict__ result) {
  double x = 0.0;
  for (int b = threadIdx.x; b < kBlocks; b += kFinalThreads) x += partials[b];
  const double total = BlockSum<kFinalThreads>(x);
  if (threadIdx.x == 0) *result = total;
}

}  // namespace

absl::Status LaunchSquaredNorm(const float* data, int64_t count, double* partials, double* result,
                               cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(data) % 16 == 0) {
    PartialsKernel<true><<<kBlocks, kThreads, 0, stream>>>(data, count, partials);
  } else {
    PartialsKernel<false><<<kBlocks, kThreads, 0, stream>>>(data, count, partials);
  }
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  FinalKernel<<<1, kFinalThreads, 0, stream>>>(partials, result);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
