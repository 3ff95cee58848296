#include "kernels/bench/random_fill.cuh"

namespace losshead::bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float Uniform(uint64_t seed, int64_t i) {
  return static_cast<float>(Mix(seed ^ Mix(static_cast<uint64_t>(i))) >> 40) * 0x1p-24f * 2.0f -
         1.0f;
}

template <typename T>
__global__ void FillKernel(T* data, int64_t count, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    data[i] = static_cast<T>(Uniform(seed, i) * scale);
  }
}

__global__ void BetweenKernel(float* data, int64_t count, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    data[i] = lo + (Uniform(seed, i) + 1.0f) * 0.5f * (hi - lo);
  }
}

__global__ void TargetsKernel(int32_t* targets, int64_t count, int64_t v, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    targets[i] = static_cast<int32_t>(Mix(seed ^ Mix(static_cast<uint64_t>(i))) % v);
  }
}

}  // namespace

cudaError_t FillUniformBf16(__nv_bfloat16* data, int64_t count, float scale, uint64_t seed,
                            cudaStream_t stream) {
  FillKernel<<<1024, 256, 0, stream>>>(data, count, scale, seed);
  return cudaGetLastError();
}

cudaError_t FillUniformF32(float* data, int64_t count, float scale, uint64_t seed,
                           cudaStream_t stream) {
  FillKernel<<<1024, 256, 0, stream>>>(data, count, scale, seed);
  return cudaGetLastError();
}

cudaError_t FillUniformF32Between(float* data, int64_t count, float lo, float hi, uint64_t seed,
                                  cudaStream_t stream) {
  BetweenKernel<<<1024, 256, 0, stream>>>(data, count, lo, hi, seed);
  return cudaGetLastError();
}

cudaError_t FillTargets(int32_t* targets, int64_t count, int64_t v, uint64_t seed,
                        cudaStream_t stream) {
  TargetsKernel<<<256, 256, 0, stream>>>(targets, count, v, seed);
  return cudaGetLastError();
}

}  // namespace losshead::bench
