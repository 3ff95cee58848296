// The CPU optimizer step and its read-only check: one pass over the elements, split over the pool.
#ifndef LOSSHEAD_KERNELS_CPU_OPTIMIZER_STEP_H_
#define LOSSHEAD_KERNELS_CPU_OPTIMIZER_STEP_H_

#include "kernels/cpu/thread_pool.h"
#include "losshead/kernels/optimizer.h"

namespace losshead::kernels {

// Applies one step to host buffers. `problem` and `tensors` must have passed
// ValidateOptimizerStep.
void CpuOptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                      ThreadPool& pool);

// What CpuOptimizerStep would write, without writing it (Backend::CheckOptimizerStep). Same
// preconditions.
OptimizerCheck CpuCheckOptimizerStep(const OptimizerProblem& problem,
                                     const OptimizerTensors& tensors, ThreadPool& pool);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_OPTIMIZER_STEP_H_
