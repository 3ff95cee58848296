// A logits GEMM of our own for Hopper (sm_90a: bulk tensor copies and wgmma), and each row's
// softmax statistics per 256 columns taken from the tiles as they are written: what the row
// kernel's first read of the logits computes (softmax_grad.cuh), without that read.
//
// logits (rows x v, row stride ldl, bf16) = hidden (rows x d, bf16) . weight (v x d, bf16)^T,
// fp32 sums rounded once to bf16. On every shape measured it wrote the same bits as cuBLASLt's
// plan for the fused call's logits GEMM (head_gemms.h's RunLogitsGemm), at the same speed
// (docs/benchmarks/kernels.md, "Our own GEMM"). The fused call's logits GEMM on such devices
// (CudaBackendOptions::sm90_logits_gemm), its statistics the row kernel's (softmax_grad.cuh).
//
// Invariants: v, d and ldl multiples of 8 and the three pointers 16-byte aligned (the tensor
// maps' strides and addresses); ldl >= v. Columns [v, ldl) of the logits are left as they were.
// (At a width not a multiple of 8, columns just past it were written: the fused call runs its
// GEMMs on the width's aligned bulk and the last rows apart anyway, head_gemms.h.) The
// statistics, when asked for, are those of the logits as stored: for row r and tile t (columns
// [256 t, min(256 t + 256, v))), tile_stats[r * LogitsTileCount(v) + t] = the tile's
// log-sum-exp: the largest logit plus the log of the sum over the tile of exp(x - largest), exp
// taken as exp2f(x log2 e - largest log2 e) (reduce.cuh's WarpTileLse).
// Each is summed in one fixed order: the same bits on every run.
#ifndef LOSSHEAD_KERNELS_CUDA_LOGITS_GEMM_SM90_CUH_
#define LOSSHEAD_KERNELS_CUDA_LOGITS_GEMM_SM90_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

inline constexpr int64_t kLogitsStatsColumns = 256;

// Statistics per row: one per tile of 256 columns.
inline constexpr int64_t LogitsTileCount(int64_t v) {
  return (v + kLogitsStatsColumns - 1) / kLogitsStatsColumns;
}

// The largest rows, v and d the kernel takes (its indices are int).
inline constexpr int64_t kLogitsGemmSm90MaxSize = int64_t{1} << 30;

// Whether the kernel takes a width v and a D: both multiples of 8 in [8, kLogitsGemmSm90MaxSize].
inline constexpr bool LogitsGemmSm90Takes(int64_t v, int64_t d) {
  return v >= 8 && d >= 8 && v % 8 == 0 && d % 8 == 0 && v <= kLogitsGemmSm90MaxSize &&
         d <= kLogitsGemmSm90MaxSize;
}

// Whether `device` runs the kernel: compute capability 9.0 (its code is sm_90a only).
bool LogitsGemmSm90Runs(int device);

// The GEMM on `stream` (on the current device), and the statistics into `tile_stats` (rows x
// LogitsTileCount(v) floats) unless it is null. INVALID_ARGUMENT where the invariants above do
// not hold or a size is below 1; FAILED_PRECONDITION on a device LogitsGemmSm90Runs refuses.
absl::Status LaunchLogitsGemmSm90(const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                                  int64_t rows, int64_t v, int64_t d, __nv_bfloat16* logits,
                                  int64_t ldl, float* tile_stats, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_LOGITS_GEMM_SM90_CUH_
