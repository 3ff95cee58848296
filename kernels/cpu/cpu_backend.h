// The CPU reference backend: exact (fp32 math, fp32 accumulation), multithreaded, BLAS GEMMs.
#ifndef LOSSHEAD_KERNELS_CPU_CPU_BACKEND_H_
#define LOSSHEAD_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "losshead/kernels/backend.h"

namespace losshead::kernels {

// `threads` <= 0 uses every hardware thread.
std::unique_ptr<Backend> CreateCpuBackend(int threads = 0);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_CPU_BACKEND_H_
