// The CUDA backend: W, dW and the workspace in device memory, cuBLAS GEMMs per token chunk.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

// Number of visible CUDA devices; 0 when there is no driver or device.
int CudaDeviceCount();

// UNAVAILABLE when `device` does not exist.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

// Tuning knobs of the CUDA backend; the defaults are the measured best (see BENCHMARKS.md).
struct CudaBackendOptions {
  // bf16 problems only: store each chunk's logits in bf16 instead of fp32. Halves the workspace
  // per token (twice the chunk rows in the same budget, half the dW read-modify-writes) and the
  // row kernel's traffic, at the price of rounding the logits to bf16 before the softmax.
  bool bf16_logits = true;
  // Threads per row of the softmax/gradient kernel: 512 or 1024 (1024 keeps fewer rows live, so
  // the gradient pass re-reads its row from L2 more often).
  int row_threads = 512;
  // Part of the workspace handed to cuBLAS (cublasSetWorkspace), so that the library allocates
  // nothing behind the budget's back.
  size_t cublas_workspace_bytes = size_t{32} << 20;
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
