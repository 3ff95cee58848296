#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/logits_tail.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/row_vec.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// sum_i x[i] * w[i] in fp32, two at a time for bf16 (one conversion instruction per pair).
template <typename T, int kVec>
__device__ __forceinline__ float Dot(const T (&x)[kVec], const T (&w)[kVec]) {
  float sum = 0.0f;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && kVec % 2 == 0) {
#pragma unroll
    for (int i = 0; i < kVec; i += 2) {
      const float2 a = __bfloat1622float2(__nv_bfloat162(x[i], x[i + 1]));
      const float2 b = __bfloat1622float2(__nv_bfloat162(w[i], w[i + 1]));
      sum = fmaf(a.x, b.x, sum);
      sum = fmaf(a.y, b.y, sum);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum = fmaf(ToF(x[i]), ToF(w[i]), sum);
  }
  return sum;
}

// One warp per token: its lanes stride over D (kVec elements a load, 16 bytes where D and the
// pointers allow), each keeping `rows` partial sums, then a butterfly sum across the warp. Every
// warp reads the same few weight rows, which stay in L2; each token's H row is read once.
template <typename TIn, typename TL, int kVec>
__global__ void __launch_bounds__(kThreads)
    LogitsTailKernel(const TIn* __restrict__ weight, const TIn* __restrict__ hidden, int64_t d,
                     int64_t tokens, int rows, TL* __restrict__ logits, int64_t ldl) {
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  struct alignas(sizeof(TIn) * kVec) Pack {
    TIn v[kVec];
  };
  const TIn* h = hidden + t * d;
  float acc[kMaxTailRows] = {};
  for (int64_t k = static_cast<int64_t>(lane) * kVec; k < d; k += 32 * kVec) {
    const Pack x = *reinterpret_cast<const Pack*>(h + k);
#pragma unroll
    for (int j = 0; j < kMaxTailRows; ++j) {
      if (j < rows) {
        const Pack w = *reinterpret_cast<const Pack*>(weight + j * d + k);
        acc[j] += Dot(x.v, w.v);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxTailRows; ++j) {
    acc[j] = WarpAllReduce(acc[j], SumOp{});
  }
  if (lane < rows) {
    float mine = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxTailRows; ++j) mine = lane == j ? acc[j] : mine;
    logits[t * ldl + lane] = FromF<TL>(mine);
  }
}

template <typename TIn, typename TL>
absl::Status Launch(const void* weight, const void* hidden, int64_t d, int64_t tokens, int rows,
                    void* logits, int64_t ldl, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(TIn);
  const bool vectors = d % kVec == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(hidden) % 16 == 0;
  const auto blocks = static_cast<unsigned>((tokens + kWarps - 1) / kWarps);
  const auto* w = static_cast<const TIn*>(weight);
  const auto* h = static_cast<const TIn*>(hidden);
  auto* out = static_cast<TL*>(logits);
  if (vectors) {
    LogitsTailKernel<TIn, TL, kVec>
        <<<blocks, kThreads, 0, stream>>>(w, h, d, tokens, rows, out, ldl);
  } else {
    LogitsTailKernel<TIn, TL, 1><<<blocks, kThreads, 0, stream>>>(w, h, d, tokens, rows, out, ldl);
  }
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchLogitsTail(cudaDataType_t in, cudaDataType_t out, const void* weight,
                              const void* hidden, int64_t d, int64_t tokens, int rows, void* logits,
                              int64_t ldl, cudaStream_t stream) {
  if (rows < 1 || rows > kMaxTailRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("a logits tail has 1 to ", kMaxTailRows, " rows, got ", rows));
  }
  if (tokens <= 0) return absl::OkStatus();
  const bool fp32_out = out == CUDA_R_32F;
  // The pairs WithRunTypes (run_types.cuh) uses: logits in bf16 only for bf16 inputs.
  switch (in) {
    case CUDA_R_16BF:
      return fp32_out ? Launch<__nv_bfloat16, float>(weight, hidden, d, tokens, rows, logits, ldl,
                                                     stream)
                      : Launch<__nv_bfloat16, __nv_bfloat16>(weight, hidden, d, tokens, rows,
                                                             logits, ldl, stream);
    case CUDA_R_16F:
      if (!fp32_out) break;
      return Launch<__half, float>(weight, hidden, d, tokens, rows, logits, ldl, stream);
    case CUDA_R_32F:
      if (!fp32_out) break;
      return Launch<float, float>(weight, hidden, d, tokens, rows, logits, ldl, stream);
    default:
      break;
  }
  return absl::InvalidArgumentError(
      "a logits tail reads bf16 into bf16 or fp32 logits, or fp16 or fp32 into fp32 logits");
}

}  // namespace losshead::kernels::cuda
