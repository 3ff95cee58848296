// Where each part of the CUDA backend's workspace lives for a token chunk: the device scalars,
// the per-row losses, cublasLt's slice, the logits chunk, where a 16-bit dH is summed over a
// split width (head_gemms.h) its fp32 scratch and, where our own logits GEMM runs, its softmax
// statistics per row and tile (logits_gemm_sm90.cuh). Run and a vocabulary shard's calls
// share the layout; a shard's logits are as wide as its rows.
#ifndef LOSSHEAD_KERNELS_CUDA_CHUNK_LAYOUT_H_
#define LOSSHEAD_KERNELS_CUDA_CHUNK_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/scalars.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels::cuda {

constexpr size_t kAlign = 256;
constexpr size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Logits row stride in elements: a multiple of 16, so that every row starts 16-byte aligned for
// the row kernels' vector loads (in bf16 or fp32).
constexpr int64_t LogitsStride(int64_t width) { return (width + 15) / 16 * 16; }

// Whether a problem's logits chunk is stored in bf16 (CudaBackendOptions::bf16_logits).
inline bool Bf16Logits(const Problem& problem, const CudaBackendOptions& options) {
  return problem.dtype == DType::kBF16 && options.bf16_logits;
}

struct Layout {
  int64_t chunk = 0;       // token rows
  int64_t ldl = 0;         // logits row stride in elements
  size_t logits_elem = 0;  // bytes per logits element
  size_t scalars_off = 0;  // RunScalars, at offset 0 whatever the chunk
  size_t row_loss_off = 0;
  size_t cublas_off = 0;
  size_t cublas_bytes = 0;
  size_t logits_off = 0;
  size_t scratch_off = 0;  // chunk x scratch_row_floats fp32, after the logits
  int64_t scratch_row_floats = 0;
  size_t stats_off = 0;  // chunk x stats_row_floats fp32, after the scratch
  int64_t stats_row_floats = 0;
  size_t total = 0;
};

// The layout of a chunk of `chunk` token rows whose logits are `width` wide, with
// `scratch_row_floats` fp32 of scratch and `stats_row_floats` fp32 of statistics per token row.
inline Layout ChunkLayout(int64_t chunk, int64_t width, size_t logits_elem, size_t cublas_bytes,
                          int64_t scratch_row_floats = 0, int64_t stats_row_floats = 0) {
  Layout l;
  l.chunk = chunk;
  l.ldl = LogitsStride(width);
  l.logits_elem = logits_elem;
  l.scalars_off = 0;
  l.row_loss_off = AlignUp(sizeof(RunScalars));
  l.cublas_off = l.row_loss_off + AlignUp(static_cast<size_t>(chunk) * sizeof(float));
  l.cublas_bytes = AlignUp(cublas_bytes);
  l.logits_off = l.cublas_off + l.cublas_bytes;
  const size_t logits_end = l.logits_off + static_cast<size_t>(chunk) * l.ldl * l.logits_elem;
  l.scratch_off = scratch_row_floats > 0 ? AlignUp(logits_end) : logits_end;
  l.scratch_row_floats = scratch_row_floats;
  const size_t scratch_end =
      l.scratch_off + static_cast<size_t>(chunk) * scratch_row_floats * sizeof(float);
  l.stats_off = stats_row_floats > 0 ? AlignUp(scratch_end) : scratch_end;
  l.stats_row_floats = stats_row_floats;
  l.total = l.stats_off + static_cast<size_t>(chunk) * stats_row_floats * sizeof(float);
  return l;
}

// A gradient stash of `capacity` tokens (grad_stash.h): G's rows (LogitsStride(v) elements of
// the head's dtype, `elem` bytes each), then H's rows (d elements).
struct StashLayout {
  int64_t ldg = 0;
  size_t hidden_off = 0;
  size_t total = 0;
};

inline StashLayout GradStashLayout(int64_t capacity, int64_t v, int64_t d, size_t elem) {
  StashLayout l;
  l.ldg = LogitsStride(v);
  l.hidden_off = AlignUp(static_cast<size_t>(capacity) * l.ldg * elem);
  l.total = l.hidden_off + static_cast<size_t>(capacity) * d * elem;
  return l;
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_CHUNK_LAYOUT_H_
