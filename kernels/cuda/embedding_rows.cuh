// The CUDA backend's GatherRows and IndexAddRows (backend.h): the rows of a head tied to its
// model's input embedding, and their gradient added into dW.
#ifndef LOSSHEAD_KERNELS_CUDA_EMBEDDING_ROWS_CUH_
#define LOSSHEAD_KERNELS_CUDA_EMBEDDING_ROWS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels::cuda {

// out row i = weights row ids[i], `element_bytes` (2 or 4) per element, copied as raw bits.
absl::Status LaunchGatherRows(const void* weights, size_t element_bytes, int64_t d,
                              const int64_t* ids, int64_t n, void* out, cudaStream_t stream);

// ids non-decreasing: the first row of each run of equal ids sums the run's values in ascending
// order (one thread per column), then adds the sum into its grad row once. No atomics: a row is
// written by one block only, so the bits are fixed by the inputs (and equal the CPU backend's).
absl::Status LaunchIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                                float* grad, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_EMBEDDING_ROWS_CUH_
