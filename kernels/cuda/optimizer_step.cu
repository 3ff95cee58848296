#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/optimizer_step.cuh"
#include "kernels/cuda/reduce.cuh"

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

// One vectorised unit's values: a float4 of each buffer (zero state where the rule keeps none).
struct Unit4 {
  float g[kVec], p[kVec], a[kVec] = {}, b[kVec] = {};
};

__device__ __forceinline__ void LoadUnit4(const float* grad, const float* param,
                                          const float* state_a, const float* state_b, bool has_a,
                                          bool has_b, int64_t u, Unit4& x) {
  Load4(grad, u, x.g);
  Load4(param, u, x.p);
  if (has_a) Load4(state_a, u, x.a);
  if (has_b) Load4(state_b, u, x.b);
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
    Unit4 x;
    LoadUnit4(grad, param, state_a, state_b, has_a, has_b, u, x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) Rule::Apply(s, x.g[k], x.p[k], x.a[k], x.b[k]);
    Store4(param, u, x.p);
    if (has_a) Store4(state_a, u, x.a);
    if (has_b) Store4(state_b, u, x.b);
    if constexpr (kRound) StoreRounded4(rounded, u, x.p);
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

__device__ __forceinline__ bool RoundsFinite(__nv_bfloat16 w) { return !__hisinf(w); }
__device__ __forceinline__ bool RoundsFinite(__half w) { return !__hisinf(w); }

// What StepKernel computes for one element, judged instead of stored.
template <typename TW>
__device__ __forceinline__ void Judge(float p, float a, float b, uint32_t& nonfinite,
                                      OptimizerCheck& largest) {
  bool finite = isfinite(p) && isfinite(a) && isfinite(b);
  if constexpr (!std::is_same_v<TW, float>) finite = finite && RoundsFinite(Round<TW>(p));
  nonfinite += finite ? 0 : 1;
  largest.weight = fmaxf(largest.weight, fabsf(p));
  largest.state_a = fmaxf(largest.state_a, fabsf(a));
  largest.state_b = fmaxf(largest.state_b, fabsf(b));
}

// Non-negative floats (and +Inf) order as their bits do, so an unsigned atomicMax keeps the
// largest; NaN never reaches here (fmaxf left it out).
__device__ __forceinline__ void AtomicMaxMagnitude(float* target, float value) {
  atomicMax(reinterpret_cast<unsigned int*>(target), __float_as_uint(value));
}

// The step's dry run: each thread walks work units as StepKernel numbers them, grid-strided (a
// fixed grid, so that few atomics are issued: one set per warp), computing every new value with
// the same Rule and adding only the warp's count and maxima into *result (zeroed beforehand).
template <typename Rule, typename TW>
__global__ void __launch_bounds__(kThreads)
    CheckKernel(StepScalars s, const float* __restrict__ param, const float* __restrict__ grad,
                const float* __restrict__ state_a, const float* __restrict__ state_b,
                int64_t vec_units, int64_t count, OptimizerCheck* __restrict__ result) {
  const bool has_a = Rule::kStates >= 1 && state_a != nullptr;
  const bool has_b = Rule::kStates >= 2 && state_b != nullptr;
  const int64_t units = vec_units + (count - vec_units * kVec);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t nonfinite = 0;
  OptimizerCheck largest;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; u < units;
       u += stride) {
    if (u < vec_units) {
      Unit4 x;
      LoadUnit4(grad, param, state_a, state_b, has_a, has_b, u, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        Rule::Apply(s, x.g[k], x.p[k], x.a[k], x.b[k]);
        Judge<TW>(x.p[k], x.a[k], x.b[k], nonfinite, largest);
      }
    } else {
      const int64_t i = vec_units * kVec + (u - vec_units);
      float p = param[i];
      float a = has_a ? state_a[i] : 0.0f;
      float b = has_b ? state_b[i] : 0.0f;
      Rule::Apply(s, grad[i], p, a, b);
      Judge<TW>(p, a, b, nonfinite, largest);
    }
  }
  nonfinite = WarpReduce(nonfinite, SumOp{});
  largest.weight = WarpReduce(largest.weight, MaxOp{});
  largest.state_a = WarpReduce(largest.state_a, MaxOp{});
  largest.state_b = WarpReduce(largest.state_b, MaxOp{});
  if (threadIdx.x % 32 == 0) {
    if (nonfinite > 0) atomicAdd(&result->nonfinite, nonfinite);
    AtomicMaxMagnitude(&result->weight, largest.weight);
    AtomicMaxMagnitude(&result->state_a, largest.state_a);
    AtomicMaxMagnitude(&result->state_b, largest.state_b);
  }
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

template <typename Rule, typename TW>
absl::Status LaunchCheck(const StepScalars& s, const float* param, const float* grad,
                         const float* state_a, const float* state_b, int64_t count,
                         OptimizerCheck* result, cudaStream_t stream) {
  // The same split into float4 and single units as the step (the bits do not depend on it).
  const bool vectorised =
      Aligned(param, 16) && Aligned(grad, 16) && Aligned(state_a, 16) && Aligned(state_b, 16);
  const int64_t vec_units = vectorised ? count / kVec : 0;
  const int64_t units = vec_units + (count - vec_units * kVec);
  int device = 0, sms = 0;
  LOSSHEAD_CUDA_CHECK(cudaGetDevice(&device));
  LOSSHEAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Enough blocks to fill every SM several times over; each walks many units.
  const int64_t wanted = (units + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 8)));
  LOSSHEAD_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(OptimizerCheck), stream));
  CheckKernel<Rule, TW>
      <<<blocks, kThreads, 0, stream>>>(s, param, grad, state_a, state_b, vec_units, count, result);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

template <typename TW>
absl::Status LaunchOptimizerCheck(OptimizerKind kind, const StepScalars& scalars,
                                  const float* param, const float* grad, const float* state_a,
                                  const float* state_b, int64_t count, OptimizerCheck* result,
                                  cudaStream_t stream) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return LaunchCheck<optim::AdamWRule, TW>(scalars, param, grad, state_a, state_b, count,
                                               result, stream);
    case OptimizerKind::kSgd:
      return LaunchCheck<optim::SgdRule, TW>(scalars, param, grad, state_a, nullptr, count, result,
                                             stream);
    case OptimizerKind::kLion:
      return LaunchCheck<optim::LionRule, TW>(scalars, param, grad, state_a, nullptr, count, result,
                                              stream);
  }
  return absl::InvalidArgumentError("unknown optimizer kind");
}

template absl::Status LaunchOptimizerCheck<float>(OptimizerKind, const StepScalars&, const float*,
                                                  const float*, const float*, const float*, int64_t,
                                                  OptimizerCheck*, cudaStream_t);
template absl::Status LaunchOptimizerCheck<__nv_bfloat16>(OptimizerKind, const StepScalars&,
                                                          const float*, const float*, const float*,
                                                          const float*, int64_t, OptimizerCheck*,
                                                          cudaStream_t);
template absl::Status LaunchOptimizerCheck<__half>(OptimizerKind, const StepScalars&, const float*,
                                                   const float*, const float*, const float*,
                                                   int64_t, OptimizerCheck*, cudaStream_t);

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
