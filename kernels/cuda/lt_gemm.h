// GEMMs through cublasLt with a caller-owned workspace. A cublasLt handle allocates no device
// memory of its own (a cublas_v2 handle allocates a default workspace pool of 64 MiB on Hopper at
// creation), so every byte a call uses is in the workspace the caller budgeted.
#ifndef LOSSHEAD_KERNELS_CUDA_LT_GEMM_H_
#define LOSSHEAD_KERNELS_CUDA_LT_GEMM_H_

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

// The cudaDataType_t of an element type: float, __nv_bfloat16 or __half.
template <typename T>
constexpr cudaDataType_t CudaType();
template <>
constexpr cudaDataType_t CudaType<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t CudaType<__nv_bfloat16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t CudaType<__half>() {
  return CUDA_R_16F;
}

// Which of the fused call's three GEMMs a shape is (head_gemms.h), so that each may take its own
// cuBLASLt candidate (LtGemm::set_role_ranks); kOther for any other.
enum class GemmRole { kLogits = 0, kGradHidden = 1, kGradWeight = 2, kOther = 3 };
inline constexpr int kGemmRoles = 3;

// D = alpha * op(A) * op(B) + beta * C with C = D, column-major as in cuBLAS; fp32 sums, and
// fp32 inputs rounded to TF32 or bf16 on the tensor cores where `compute` allows it
// (CUBLAS_COMPUTE_32F_FAST_TF32, _FAST_16BF). alpha and beta point to floats in host or device
// memory (`device_scalars`).
struct GemmShape {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  int m = 0, n = 0, k = 0;
  cudaDataType_t type_a = CUDA_R_16BF, type_b = CUDA_R_16BF, type_c = CUDA_R_16BF;
  int lda = 0, ldb = 0, ldc = 0;
  bool device_scalars = false;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  GemmRole role = GemmRole::kOther;
};

// One stream's cublasLt handle plus, per shape, the descriptors and the algorithm the heuristic
// picked the first time (same shape, same algorithm: results are reproducible run to run). Not
// thread-safe: the owning stream's mutex serialises callers.
class LtGemm {
 public:
  static absl::Status Create(std::unique_ptr<LtGemm>* out);
  ~LtGemm();

  absl::Status Run(const GemmShape& shape, const void* alpha, const void* a, const void* b,
                   const void* beta, void* c, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

  // Which of the heuristic's algorithms plans made from now on take: 0, its first (the
  // default), or a later one, so that losshead_gemm_sweep can time the others. A shape whose
  // heuristic offers fewer than rank + 1 algorithms fails to plan with NOT_FOUND.
  void set_heuristic_rank(int rank) { rank_ = rank; }

  // The candidate each of the three head GEMMs' plans take from now on, by GemmRole (0: the
  // heuristic's first). A candidate is taken only where it sums over k as the first does (the
  // same kernel family, no split-K: the same bits, in another tiling) and the heuristic offers
  // it; otherwise the first. Where set_heuristic_rank asks a rank, that rank rules.
  void set_role_ranks(const int (&ranks)[kGemmRoles]) {
    for (int i = 0; i < kGemmRoles; ++i) role_ranks_[i] = ranks[i];
  }

  // The configuration of the algorithm the last Run ran (cublasLt's algorithm id, tile, stages,
  // split-K, swizzle, cluster shape, as their enum values), or "" before any Run.
  std::string LastAlgorithm() const;

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, int, int, int, int, int, int, int, int, int, int, int, int,
                         int, size_t>;
  explicit LtGemm(cublasLtHandle_t handle);
  absl::Status MakePlan(const GemmShape& shape, int align_a, int align_b, int align_c,
                        size_t workspace_bytes, Plan* plan);

  cublasLtHandle_t handle_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int rank_ = 0;
  int role_ranks_[kGemmRoles] = {0, 0, 0};
  const Plan* last_ = nullptr;
};

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_LT_GEMM_H_
