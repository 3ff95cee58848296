// The CUDA backend. Per token chunk of C rows (chunks of equal size, as large as the workspace
// allows):
//   logits (C x V)  = H_c . W^T                      cublasLt, fp32 accumulation
//   row kernel      : soft-cap, softmax, lse, loss; overwrites the logits with the unscaled
//                     gradient G in the input dtype (the next GEMMs' operand)
//   dH_c  (C x D)   = alpha . G . W                  cublasLt, written in the input dtype
//   dW    (V x D)  += alpha . G^T . H_c              cublasLt, fp32 accumulator, beta = 1
// alpha (grad_scale, / token_count for the mean) is computed on the device by a prologue kernel and
// read by cublasLt in device pointer mode, so nothing in Run waits for the GPU. cublasLt rather
// than cublas_v2: a cublas_v2 handle allocates a 64 MiB workspace pool of its own at creation,
// outside any budget; the cublasLt GEMMs use a slice of our workspace and nothing else.
// The optimizer step and the gradient norm are single memory-bound passes (optimizer_step.cu,
// squared_norm.cu) that share their per-element math with the CPU backend.
// A vocabulary shard's calls (shard_problem.h) are in shard_calls.cu. The class is in
// cuda_backend_impl.h; Run in cuda_run.cu, the optimizer step and the norm in cuda_update.cu.
// This file: the device count and the factory.
#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_check.h"

namespace losshead::kernels {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // a missing driver is "no device", not a sticky error
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  return CreateCudaBackend(device, CudaBackendOptions{});
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " visible)"));
  }
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  LOSSHEAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (options.row_threads != 512 && options.row_threads != 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("row_threads must be 512 or 1024, got ", options.row_threads));
  }
  return std::unique_ptr<Backend>(
      new cuda::CudaBackend(device, options, absl::StrCat("cuda:", device, " (", prop.name, ")"),
                      prop.sharedMemPerMultiprocessor));
}

}  // namespace losshead::kernels
