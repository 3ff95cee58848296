// The CUDA backend: W, dW and the workspace in device memory, cuBLAS GEMMs per token chunk.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

// Number of visible CUDA devices; 0 when there is no driver or device.
int CudaDeviceCount();

// UNAVAILABLE when `device` does not exist.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
