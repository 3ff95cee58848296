#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/optimizer_step.cuh"

namespace losshead::kernels::cuda {
namespace {

using optim::StepScalars;

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per thread on the vectorised path: one float4 per buffer

// Round to nearest-even, as the host's FloatToBf16 / FloatToFp16.
template <typename TW>
__device__ __forceinline__ TW Round(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 Round(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half Round(float x) {
  return __float2half_rn(x);
}

__device__ __forceinline__ uint32_t Bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t Bits(__half x) { return __half_as_ushort(x); }

// Four 16-bit weights in one 8-byte store; the lower address holds the lower half of each word.
template <typename TW>
__device__ __forceinline__ void StoreRounded4(TW* w, int64_t v, const float (&p)[kVec]) {
  uint2 bits;
  bits.x = Bits(Round<TW>(p[0])) | (Bits(Round<TW>(p[1])) << 16);
  bits.y = Bits(Round<TW>(p[2])) | (Bits(Round<TW>(p[3])) << 16);
  __stcs(reinterpret_cast<uint2*>(w) + v, bits);
}

__device__ __forceinline__ void Load4(const float* src, int64_t v, float (&dst)[kVec]) {
  const float4 x = __ldcs(reinterpret_cast<const float4*>(src) + v);
  dst[0] = x.x;
  dst[1] = x.y;
  dst[2] = x.z;
  dst[3] = x.w;
}

__device__ __forceinline__ void Store4(float* dst, int64_t v, const float (&src)[kVec]) {
  __stcs(reinterpret_cast<float4*>(dst) + v, make_float4(src[0], src[1], src[2], src[3]));
}

// Thread u of the grid handles one work unit: unit u < vec_units is the float4 at element 4u;
// the units after it are single elements from 4 * vec_units on (the tail, or everything on the
// scalar path). Every buffer is streamed once: the loads and stores bypass cache residency
// (__ldcs / __stcs) so that the 10 GiB pass does not evict anything else from L2.
template <typename Rule, typename TW>
__global__ void __launch_bounds__(kThreads)
    StepKernel(StepScalars s, float* __restrict__ param, TW* __restrict__ rounded,
               float* __restrict__ grad, float* __restrict__ state_a, float* __restrict__ state_b,
               int64_t vec_units, int64_t count) {
  constexpr bool kRound = !std::is_same_v<TW, float>;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool has_a = Rule::kStates >= 1 && state_a != nullptr;
  const bool has_b = Rule::kStates >= 2 && state_b != nullptr;
  if (u < vec_units) {
    float g[kVec], p[kVec], a[kVec] = {}, b[kVec] = {};
    Load4(grad, u, g);
    Load4(param, u, p);
    if (has_a) Load4(state_a, u, a);
    if (has_b) Load4(state_b, u, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) Rule::Apply(s, g[k], p[k], a[k], b[k]);
    Store4(param, u, p);
    if (has_a) Store4(state_a, u, a);
    if (has_b) Store4(state_b, u, b);
    if constexpr (kRound) StoreRounded4(rounded, u, p);
    const float zero[kVec] = {};
    Store4(grad, u, zero);
    return;
  }
  const int64_t i = vec_units * kVec + (u - vec_units);
  if (i >= count) return;
  float p = param[i];
  float a = has_a ? state_a[i] : 0.0f;
  float b = has_b ? state_b[i] : 0.0f;
  Rule::Apply(s, grad[i], p, a, b);
  param[i] = p;
  if (has_a) state_a[i] = a;
  if (has_b) state_b[i] = b;
  if constexpr (kRound) rounded[i] = Round<TW>(p);
  grad[i] = 0.0f;
}

bool Aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <typename Rule, typename TW>
absl::Status Launch(const StepScalars& s, float* param, TW* rounded, float* grad, float* state_a,
                    float* state_b, int64_t count, cudaStream_t stream) {
  const bool vectorised = Aligned(param, 16) && Aligned(grad, 16) && Aligned(state_a, 16) &&
                          Aligned(state_b, 16) && Aligned(rounded, kVec * sizeof(TW));
  const int64_t vec_units = vectorised ? count / kVec : 0;
  const int64_t units = vec_units + (count - vec_units * kVec);
  const int64_t blocks = (units + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) {
    return absl::InvalidArgumentError("optimizer step: count too large for one launch");
  }
  StepKernel<Rule, TW><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      s, param, rounded, grad, state_a, state_b, vec_units, count);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

template <typename TW>
absl::Status LaunchOptimizerStep(OptimizerKind kind, const StepScalars& scalars, float* param,
                                 TW* rounded, float* grad, float* state_a, float* state_b,
                                 int64_t count, cudaStream_t stream) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return Launch<optim::AdamWRule>(scalars, param, rounded, grad, state_a, state_b, count,
                                      stream);
    case OptimizerKind::kSgd:
      return Launch<optim::SgdRule>(scalars, param, rounded, grad, state_a, nullptr, count, stream);
    case OptimizerKind::kLion:
      return Launch<optim::LionRule>(scalars, param, rounded, grad, state_a, nullptr, count,
                                     stream);
  }
  return absl::InvalidArgumentError("unknown optimizer kind");
}

template absl::Status LaunchOptimizerStep<float>(OptimizerKind, const StepScalars&, float*, float*,
                                                 float*, float*, float*, int64_t, cudaStream_t);
template absl::Status LaunchOptimizerStep<__nv_bfloat16>(OptimizerKind, const StepScalars&, float*,
                                                         __nv_bfloat16*, float*, float*, float*,
                                                         int64_t, cudaStream_t);
template absl::Status LaunchOptimizerStep<__half>(OptimizerKind, const StepScalars&, float*,
                                                  __half*, float*, float*, float*, int64_t,
                                                  cudaStream_t);

}  // namespace losshead::kernels::cuda
