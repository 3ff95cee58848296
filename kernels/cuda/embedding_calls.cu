// CudaBackend's GatherRows and IndexAddRows: validation, then the launches of embedding_rows.cu
// on the caller's stream.
#include <cuda_runtime.h>

#include <mutex>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/embedding_rows.cuh"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/embedding_rows.h"

namespace losshead::kernels::cuda {

absl::Status CudaBackend::GatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                                     const int64_t* ids, int64_t n, void* out, Stream& stream) {
  if (absl::Status s = ValidateGatherRows(dtype, weights, rows, d, ids, n, out); !s.ok()) return s;
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return LaunchGatherRows(weights, DTypeSize(dtype), d, ids, n, out, cs->stream());
}

absl::Status CudaBackend::IndexAddRows(const float* values, const int64_t* ids, int64_t n,
                                       int64_t d, float* grad, int64_t rows, Stream& stream) {
  if (absl::Status s = ValidateIndexAddRows(values, ids, n, d, grad, rows); !s.ok()) return s;
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return LaunchIndexAddRows(values, ids, n, d, grad, cs->stream());
}

}  // namespace losshead::kernels::cuda
