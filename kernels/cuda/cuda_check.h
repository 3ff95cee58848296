// Status-returning checks for CUDA runtime and cuBLAS calls. Library code never aborts: a failed
// call becomes an absl::Status naming the call, the error and the file:line where it happened.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_CHECK_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_CHECK_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace losshead::kernels::cuda {

inline absl::Status CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  // The failure is reported here, so the thread's last-error slot must not keep it: a failed
  // cudaMalloc would otherwise fail the next kernel launch's check (LOSSHEAD_CUDA_CHECK_LAUNCH)
  // of a run that is fine. Sticky errors (a broken context) are not cleared by this.
  cudaGetLastError();
  // Out-of-memory is the caller's budget problem, not a broken device: keep the distinction.
  const std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                       cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

inline absl::Status CublasError(cublasStatus_t err, const char* expr, const char* file, int line) {
  cudaGetLastError();  // as in CudaError: an allocation cuBLAS failed must not fail the next launch
  const std::string msg = absl::StrCat(file, ":", line, ": ", expr,
                                       " failed: ", cublasGetStatusName(err), " (",
                                       cublasGetStatusString(err), ")");
  if (err == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace losshead::kernels::cuda

#define LOSSHEAD_CUDA_CHECK(expr)                                                         \
  do {                                                                                    \
    const cudaError_t losshead_cuda_err_ = (expr);                                        \
    if (losshead_cuda_err_ != cudaSuccess) {                                              \
      return ::losshead::kernels::cuda::CudaError(losshead_cuda_err_, #expr, __FILE__,    \
                                                  __LINE__);                              \
    }                                                                                     \
  } while (0)

#define LOSSHEAD_CUBLAS_CHECK(expr)                                                       \
  do {                                                                                    \
    const cublasStatus_t losshead_cublas_err_ = (expr);                                   \
    if (losshead_cublas_err_ != CUBLAS_STATUS_SUCCESS) {                                  \
      return ::losshead::kernels::cuda::CublasError(losshead_cublas_err_, #expr, __FILE__, \
                                                    __LINE__);                            \
    }                                                                                     \
  } while (0)

// A kernel launch reports configuration errors only through cudaGetLastError.
#define LOSSHEAD_CUDA_CHECK_LAUNCH() LOSSHEAD_CUDA_CHECK(cudaGetLastError())

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_CHECK_H_
