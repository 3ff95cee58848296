// The three GEMMs of a token chunk, shared by Run, FlushGradStash and a vocabulary shard's calls
// (whose `width` is the shard's rows instead of V): their shapes, and the calls that run them
// over the width in aligned parts. Column-major views, as cuBLAS sees the row-major buffers:
// W (width x D) is W_cm (D x width), H_c (tokens x D) is H_cm (D x tokens), and the logits / G
// chunk (tokens x width, row stride ld) is G_cm (width x tokens, ld).
#ifndef LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_
#define LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/logits_gemm_sm90.cuh"
#include "kernels/cuda/logits_tail.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels::cuda {

// How a problem's GEMMs compute: fp32 sums always; an fp32 problem's inputs on the TF32 or bf16
// tensor cores where its precision allows (problem.h), IEEE fp32 products otherwise.
inline cublasComputeType_t GemmCompute(const Problem& problem) {
  if (problem.dtype != DType::kFP32) return CUBLAS_COMPUTE_32F;
  switch (problem.precision) {
    case MatmulPrecision::kHigh:
      return CUBLAS_COMPUTE_32F_FAST_TF32;
    case MatmulPrecision::kMedium:
      return CUBLAS_COMPUTE_32F_FAST_16BF;
    case MatmulPrecision::kHighest:
      break;
  }
  return CUBLAS_COMPUTE_32F;
}

// logits^T (width x tokens, ld ldl) = W^T_cm (width x D) . H_cm (D x tokens). Host scalars: with
// a device beta cublasLt cannot know it is 0 and reads the whole output back in its epilogue.
inline GemmShape LogitsGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                            cublasComputeType_t compute, cudaDataType_t logits, int64_t ldl) {
  GemmShape g;
  g.role = GemmRole::kLogits;
  g.compute = compute;
  g.trans_a = CUBLAS_OP_T;
  g.m = static_cast<int>(width);
  g.n = static_cast<int>(tokens);
  g.k = static_cast<int>(d);
  g.type_a = g.type_b = in;
  g.type_c = logits;
  g.lda = g.ldb = static_cast<int>(d);
  g.ldc = static_cast<int>(ldl);
  return g;
}

// dH_cm (D x tokens) = alpha . W_cm (D x width) . G_cm (width x tokens, ld ldg); alpha on the
// device (the mean's 1 / token count is known only there).
inline GemmShape GradHiddenGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                                cublasComputeType_t compute, cudaDataType_t out, int64_t ldg) {
  GemmShape g;
  g.role = GemmRole::kGradHidden;
  g.compute = compute;
  g.m = static_cast<int>(d);
  g.n = static_cast<int>(tokens);
  g.k = static_cast<int>(width);
  g.type_a = g.type_b = in;
  g.type_c = out;
  g.lda = g.ldc = static_cast<int>(d);
  g.ldb = static_cast<int>(ldg);
  g.device_scalars = true;
  return g;
}

// dW_cm (D x width) += alpha . H_cm (D x tokens) . G_cm^T (tokens x width), into the fp32
// accumulator (beta = 1); alpha on the device.
inline GemmShape GradWeightGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                                cublasComputeType_t compute, int64_t ldg) {
  GemmShape g;
  g.role = GemmRole::kGradWeight;
  g.compute = compute;
  g.trans_b = CUBLAS_OP_T;
  g.m = static_cast<int>(d);
  g.n = static_cast<int>(width);
  g.k = static_cast<int>(tokens);
  g.type_a = g.type_b = in;
  g.type_c = CUDA_R_32F;
  g.lda = g.ldc = static_cast<int>(d);
  g.ldb = static_cast<int>(ldg);
  g.device_scalars = true;
  return g;
}

// cuBLASLt runs its Hopper kernels only where a matrix's contiguous extent is a whole number of
// 16-byte vectors, and the width is such an extent in all three GEMMs (the logits' rows, G's
// rows, dW's columns). A width that is not a multiple of 8 rows (V = 50257, or a shard of 695,970
// rows) fell back to sm75 and sm80 kernels and ran 3-5x slower on an H100, torch's matmuls as
// much as ours (BENCHMARKS.md, "Widths that are not a multiple of 8"). So every GEMM over the
// width runs on its aligned bulk and, apart, on the tail of fewer than kWidthAlign rows: the bulk
// gets the fast kernels, the tail's dH and dW GEMMs are tiny, and its logits have a kernel of
// their own (logits_tail.cuh). 8 rows are 16 bytes of a 16-bit operand (and 32 of fp32), the
// most a width needs: V = 50264 or 128264 runs as fast as 128256 whole.
inline constexpr int64_t kWidthAlign = kMaxTailRows + 1;

struct WidthPart {
  int64_t begin = 0;
  int64_t size = 0;
};

// The non-empty parts of [0, width): the bulk [0, width rounded down to kWidthAlign) and the
// tail, in that order.
struct WidthParts {
  WidthPart part[2];
  int count = 0;
  const WidthPart* begin() const { return part; }
  const WidthPart* end() const { return part + count; }
};

// The width's aligned bulk: rounded down to kWidthAlign.
inline int64_t WidthBulk(int64_t width) { return width / kWidthAlign * kWidthAlign; }

inline WidthParts SplitWidth(int64_t width) {
  WidthParts parts;
  const int64_t bulk = WidthBulk(width);
  if (bulk > 0) parts.part[parts.count++] = {0, bulk};
  if (bulk < width) parts.part[parts.count++] = {bulk, width - bulk};
  return parts;
}

// Whether a dH GEMM over `width` adds partial sums in its output: a 16-bit dH must then go
// through fp32 (RunGradHiddenGemm).
inline bool WidthSplits(int64_t width) { return SplitWidth(width).count > 1; }

inline size_t ElementBytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : 2; }

template <typename T>
T* Advance(T* p, int64_t elements, cudaDataType_t type) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) +
                              static_cast<ptrdiff_t>(elements) * ElementBytes(type));
}

// logits (tokens x width, row stride ldl, type `out`) = H_c . W^T: the bulk by cuBLASLt (host
// scalars, LogitsGemm), the tail's few columns by LaunchLogitsTail (in IEEE fp32 whatever
// `compute` allows: a few columns gain nothing from rounding).
inline absl::Status RunLogitsGemm(LtGemm& gemm, int64_t width, int64_t tokens, int64_t d,
                                  cudaDataType_t in, cublasComputeType_t compute,
                                  cudaDataType_t out, int64_t ldl, const void* weight,
                                  const void* hidden, void* logits, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  static constexpr float kOne = 1.0f, kZero = 0.0f;
  for (const WidthPart& part : SplitWidth(width)) {
    const void* rows = Advance(weight, part.begin * d, in);
    void* columns = Advance(logits, part.begin, out);
    if (part.size < kWidthAlign) {
      LOSSHEAD_RETURN_IF_ERROR(LaunchLogitsTail(in, out, rows, hidden, d, tokens,
                                                static_cast<int>(part.size), columns, ldl, stream));
    } else {
      LOSSHEAD_RETURN_IF_ERROR(gemm.Run(LogitsGemm(part.size, tokens, d, in, compute, out, ldl),
                                        &kOne, rows, hidden, &kZero, columns, workspace,
                                        workspace_bytes, stream));
    }
  }
  return absl::OkStatus();
}

// Whether our own logits GEMM (logits_gemm_sm90.cuh) takes a width's bulk at this D.
inline bool Sm90LogitsGemmFits(int64_t width, int64_t d) {
  return LogitsGemmSm90Takes(WidthBulk(width), d);
}

// Its statistics per token row: one float per 256 columns of the bulk.
inline int64_t Sm90StatsPerRow(int64_t width) { return LogitsTileCount(WidthBulk(width)); }

// RunLogitsGemm for bf16 operands and logits by our own GEMM (Sm90LogitsGemmFits; H and W 16-byte
// aligned, ldl a multiple of 8): the bulk, with each row's statistics of its tiles into
// tile_stats + r * Sm90StatsPerRow(width) unless tile_stats is null, then the tail as there.
inline absl::Status RunLogitsGemmSm90(int64_t width, int64_t tokens, int64_t d, int64_t ldl,
                                      const __nv_bfloat16* weight, const __nv_bfloat16* hidden,
                                      __nv_bfloat16* logits, float* tile_stats,
                                      cudaStream_t stream) {
  const int64_t bulk = WidthBulk(width);
  LOSSHEAD_RETURN_IF_ERROR(
      LaunchLogitsGemmSm90(hidden, weight, tokens, bulk, d, logits, ldl, tile_stats, stream));
  if (bulk == width) return absl::OkStatus();
  return LaunchLogitsTail(CUDA_R_16BF, CUDA_R_16BF, weight + bulk * d, hidden, d, tokens,
                          static_cast<int>(width - bulk), logits + bulk, ldl, stream);
}

// dH_cm (D x tokens, type `out`) = alpha . W_cm . G_cm (G's row stride ldg) + beta . dH_cm, the
// scalars on the device; `one` points to 1.0f there. The parts add up in dH, so where the width
// splits `out` must be fp32 (INTERNAL otherwise, nothing launched): a 16-bit dH then goes through
// fp32 scratch.
inline absl::Status RunGradHiddenGemm(LtGemm& gemm, int64_t width, int64_t tokens, int64_t d,
                                      cudaDataType_t in, cublasComputeType_t compute,
                                      cudaDataType_t out, int64_t ldg, const float* alpha,
                                      const void* weight, const void* grad, const float* beta,
                                      const float* one, void* grad_hidden, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream) {
  if (WidthSplits(width) && out != CUDA_R_32F) {
    return absl::InternalError("a dH GEMM over a split width must add its parts in fp32");
  }
  for (const WidthPart& part : SplitWidth(width)) {
    LOSSHEAD_RETURN_IF_ERROR(gemm.Run(GradHiddenGemm(part.size, tokens, d, in, compute, out, ldg),
                                      alpha, Advance(weight, part.begin * d, in),
                                      Advance(grad, part.begin, in), part.begin == 0 ? beta : one,
                                      grad_hidden, workspace, workspace_bytes, stream));
  }
  return absl::OkStatus();
}

// dW_cm (D x width, fp32) = alpha . H_cm . G_cm^T + beta . dW_cm; scalars on the device, or on
// the host where `host_scalars`.
inline absl::Status RunGradWeightGemm(LtGemm& gemm, int64_t width, int64_t tokens, int64_t d,
                                      cudaDataType_t in, cublasComputeType_t compute, int64_t ldg,
                                      const float* alpha, const void* hidden, const void* grad,
                                      const float* beta, float* grad_weight, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream,
                                      bool host_scalars = false) {
  for (const WidthPart& part : SplitWidth(width)) {
    GemmShape shape = GradWeightGemm(part.size, tokens, d, in, compute, ldg);
    shape.device_scalars = !host_scalars;
    LOSSHEAD_RETURN_IF_ERROR(gemm.Run(shape, alpha, hidden, Advance(grad, part.begin, in), beta,
                                      grad_weight + part.begin * d, workspace, workspace_bytes,
                                      stream));
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_
