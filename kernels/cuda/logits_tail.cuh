// The logits of the few vocabulary rows past a width's aligned bulk (head_gemms.h): per token,
// fewer than 8 dot products of length D.
#ifndef LOSSHEAD_KERNELS_CUDA_LOGITS_TAIL_CUH_
#define LOSSHEAD_KERNELS_CUDA_LOGITS_TAIL_CUH_

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

// The most rows a tail has: one less than head_gemms.h's kWidthAlign.
inline constexpr int kMaxTailRows = 7;

// logits[t * ldl + j] = sum_k hidden[t * d + k] * weight[j * d + k], accumulated in fp32 and
// rounded once to `out`, for t < tokens and j < rows. `in` is the type of weight and hidden,
// `out` the logits': bf16 into bf16 or fp32, fp16 or fp32 into fp32 (run_types.cuh's pairs).
// cuBLASLt's pick for so thin a GEMM ran a 64 x 256 tile on 44 blocks, 0.9 ms for a 2816-token
// chunk at D = 4096 on an H100 (ncu), where this reads H once at memory speed. INVALID_ARGUMENT,
// nothing launched, for rows outside [1, kMaxTailRows] or another type pair.
absl::Status LaunchLogitsTail(cudaDataType_t in, cudaDataType_t out, const void* weight,
                              const void* hidden, int64_t d, int64_t tokens, int rows, void* logits,
                              int64_t ldl, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_LOGITS_TAIL_CUH_
