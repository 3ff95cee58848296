// Adds one chunk's per-token losses to the run's loss sum, in a fixed order (deterministic).
#ifndef LOSSHEAD_KERNELS_CUDA_LOSS_REDUCE_CUH_
#define LOSSHEAD_KERNELS_CUDA_LOSS_REDUCE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/scalars.h"

namespace losshead::kernels::cuda {

// scalars->loss_acc += sum(row_loss[0, rows)) in fp64, then *loss_sum = (float)loss_acc. Atomics
// would make the sum depend on block scheduling; one block per chunk keeps it bit-reproducible.
absl::Status LaunchLossReduce(const float* row_loss, int64_t rows, RunScalars* scalars,
                              float* loss_sum, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_LOSS_REDUCE_CUH_
