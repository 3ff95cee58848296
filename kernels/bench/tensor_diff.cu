#include <cuda_bf16.h>

#include <cmath>

#include "kernels/bench/tensor_diff.cuh"

namespace losshead::bench {
namespace {

struct DiffSums {
  double squared_error, squared_reference;
  unsigned long long differing;
};

template <typename T>
__device__ float AsFloat(T x) {
  if constexpr (sizeof(T) == 2) {
    return __bfloat162float(x);
  } else {
    return x;
  }
}

template <typename T, typename Bits>
__global__ void DiffKernel(const T* a, const T* b, int64_t count, DiffSums* sums) {
  double err = 0, ref = 0;
  unsigned long long differing = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double x = AsFloat(a[i]), y = AsFloat(b[i]);
    err += (x - y) * (x - y);
    ref += y * y;
    differing += reinterpret_cast<const Bits*>(a)[i] != reinterpret_cast<const Bits*>(b)[i];
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    err += __shfl_down_sync(0xffffffffu, err, offset);
    ref += __shfl_down_sync(0xffffffffu, ref, offset);
    differing += __shfl_down_sync(0xffffffffu, differing, offset);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums->squared_error, err);
    atomicAdd(&sums->squared_reference, ref);
    atomicAdd(&sums->differing, differing);
  }
}

}  // namespace

cudaError_t DiffTensors(const void* a, const void* b, int64_t count, bool fp32, cudaStream_t stream,
                        TensorDiff* out) {
  DiffSums* sums = nullptr;
  cudaError_t e = cudaMallocAsync(&sums, sizeof(DiffSums), stream);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(sums, 0, sizeof(DiffSums), stream);
  if (e == cudaSuccess) {
    constexpr int kThreads = 256, kBlocks = 1024;
    if (fp32) {
      DiffKernel<float, uint32_t><<<kBlocks, kThreads, 0, stream>>>(
          static_cast<const float*>(a), static_cast<const float*>(b), count, sums);
    } else {
      DiffKernel<__nv_bfloat16, uint16_t><<<kBlocks, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), count, sums);
    }
    e = cudaGetLastError();
  }
  DiffSums host{};
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(&host, sums, sizeof(host), cudaMemcpyDeviceToHost, stream);
  const cudaError_t freed = cudaFreeAsync(sums, stream);
  if (e == cudaSuccess) e = freed;
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return e;
  out->relative = std::sqrt(host.squared_error) / std::sqrt(host.squared_reference);
  out->differing = static_cast<int64_t>(host.differing);
  return cudaSuccess;
}

}  // namespace losshead::bench
