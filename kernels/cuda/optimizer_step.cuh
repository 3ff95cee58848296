// The fused optimizer step: one pass that reads the gradient, the fp32 parameters and the state,
// and writes the parameters, the state, the rounded weights and a zeroed gradient; and its
// read-only dry run.
#ifndef LOSSHEAD_KERNELS_CUDA_OPTIMIZER_STEP_CUH_
#define LOSSHEAD_KERNELS_CUDA_OPTIMIZER_STEP_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/common/optimizer_math.h"
#include "losshead/kernels/optimizer.h"

namespace losshead::kernels::cuda {

// Updates `count` elements with the rule of `kind` (optim::AdamWRule, SgdRule, LionRule):
// `param` holds the fp32 parameters (the master, or the weights themselves when TW is float);
// `rounded` receives them rounded to nearest-even in TW (null when TW is float); `grad` is read
// and zeroed; `state_a` / `state_b` are the rule's state (null where the rule keeps none; SGD
// without momentum passes null). 16-byte aligned fp32 buffers and 8-byte aligned 16-bit weights
// take the vectorised path, anything else the scalar one, with identical results.
template <typename TW>
absl::Status LaunchOptimizerStep(OptimizerKind kind, const optim::StepScalars& scalars,
                                 float* param, TW* rounded, float* grad, float* state_a,
                                 float* state_b, int64_t count, cudaStream_t stream);

// The step's dry run (Backend::CheckOptimizerStep): the same units and Rule as
// LaunchOptimizerStep<TW>, reading the same buffers and writing only *result (device memory,
// zeroed here first): the elements whose new parameter, state or TW rounding would not be finite,
// and the largest new magnitudes.
template <typename TW>
absl::Status LaunchOptimizerCheck(OptimizerKind kind, const optim::StepScalars& scalars,
                                  const float* param, const float* grad, const float* state_a,
                                  const float* state_b, int64_t count, OptimizerCheck* result,
                                  cudaStream_t stream);

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_OPTIMIZER_STEP_CUH_
