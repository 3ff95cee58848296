// The element types a run is instantiated for: the head's dtype as TIn, and the logits chunk's
// as TL (bf16 where Bf16Logits chooses it, else fp32). Run and a vocabulary shard's Forward and
// Backward pick their kernels' instantiation through this one switch.
#ifndef LOSSHEAD_KERNELS_CUDA_RUN_TYPES_CUH_
#define LOSSHEAD_KERNELS_CUDA_RUN_TYPES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "absl/status/status.h"
#include "kernels/cuda/chunk_layout.h"

namespace losshead::kernels::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

// Returns run(TypeTag<TIn>{}, TypeTag<TL>{}) for the problem's types.
template <typename Run>
absl::Status WithRunTypes(const Problem& problem, const CudaBackendOptions& options, Run&& run) {
  switch (problem.dtype) {
    case DType::kFP32:
      return run(TypeTag<float>{}, TypeTag<float>{});
    case DType::kFP16:
      return run(TypeTag<__half>{}, TypeTag<float>{});
    case DType::kBF16:
      if (Bf16Logits(problem, options)) {
        return run(TypeTag<__nv_bfloat16>{}, TypeTag<__nv_bfloat16>{});
      }
      return run(TypeTag<__nv_bfloat16>{}, TypeTag<float>{});
  }
  return absl::InvalidArgumentError("unknown dtype");
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_RUN_TYPES_CUH_
