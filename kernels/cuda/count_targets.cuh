// Run prologue: counts the tokens that take part in the loss and prepares the run's scalars.
#ifndef LOSSHEAD_KERNELS_CUDA_COUNT_TARGETS_CUH_
#define LOSSHEAD_KERNELS_CUDA_COUNT_TARGETS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/scalars.h"

namespace losshead::kernels::cuda {

// Counts targets t of `targets[0, n)` with t != ignore_index and 0 <= t < v (an out-of-range
// target is treated as ignored so that no kernel indexes outside the logits row), writes the count
// to `token_count` (optional), and fills `scalars`: grad_alpha = grad_scale / count when `mean`
// (0 when nothing is counted), grad_scale otherwise; loss_acc = 0. One block: the count runs once
// per call and is tiny next to the GEMMs.
absl::Status LaunchCountTargets(const int32_t* targets, int64_t n, int64_t v, int64_t ignore_index,
                                bool mean, float grad_scale, int64_t* token_count,
                                RunScalars* scalars, cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_COUNT_TARGETS_CUH_
