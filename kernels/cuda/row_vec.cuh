// Device helpers shared by the row kernels (softmax_grad.cu, shard_softmax.cu): conversions to
// and from fp32, 16-byte vectors of logits, and vectors of gradients stored with one instruction.
// (The soft-cap is loss_math.h's; the reductions are reduce.cuh's.)
#ifndef LOSSHEAD_KERNELS_CUDA_ROW_VEC_CUH_
#define LOSSHEAD_KERNELS_CUDA_ROW_VEC_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace losshead::kernels::cuda {

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}

// A 16-byte vector of TL values.
template <typename TL>
struct Vec {
  static constexpr int kSize = 16 / sizeof(TL);
  union {
    uint4 raw;
    TL v[kSize];
  };
};

// kSize values of TG, stored with one instruction (8 or 16 bytes).
template <typename TG, int kSize>
struct alignas(sizeof(TG) * kSize) OutVec {
  TG v[kSize];
};

// G is read next by the gradient GEMMs, long after the row kernel: store it evict-first so that
// it does not push out of L2 the logits rows that other blocks are about to read.
template <typename Out>
__device__ __forceinline__ void StoreStreaming(Out* p, const Out& v) {
  if constexpr (sizeof(Out) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else if constexpr (sizeof(Out) == 8) {
    __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&v));
  } else {
    *p = v;
  }
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_ROW_VEC_CUH_
