// The CUDA backend's vocabulary-shard calls (losshead/kernels/shard_problem.h), per token chunk:
//   ShardForward    logits (C x rows) = H_c . W_rows^T (bf16 or fp32 as in Run, kept in the
//                   workspace), then per token the shard's statistics (shard_softmax.cu)
//   ShardBackward   combine the gathered statistics; G over the shard's columns (written over the
//                   logits as in Run); partial_c (C x D, fp32) = alpha . G . W_rows;
//                   dW_rows += alpha . G^T . H_c; db_rows += alpha . column sums of G / logit_scale
// With the model options and loss terms (problem.h) both row kernels run their terms' instantiation
// (shard_softmax.cuh): the GEMMs are the plain ones, and a call without them is the plain path.
//   ShardStoreGradHidden  the summed partials rounded to the problem's dtype
// CudaBackend forwards its Shard* overrides here with the caller's stream resolved.
#ifndef LOSSHEAD_KERNELS_CUDA_SHARD_CALLS_H_
#define LOSSHEAD_KERNELS_CUDA_SHARD_CALLS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/chunk_layout.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_stream.h"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels::cuda {

// Each call takes `cs`, the caller's stream as a CudaStream of this device, or null for a stream
// another backend made (INVALID_ARGUMENT, nothing launched); it takes the stream's mutex.
class ShardCalls {
 public:
  ShardCalls(int device, const CudaBackendOptions& options) : device_(device), options_(options) {}

  absl::StatusOr<ShardPlan> Plan(const ShardProblem& shard, size_t budget_bytes) const;
  absl::Status Begin(const ShardProblem& shard, const ShardArguments& args, CudaStream* cs) const;
  absl::Status Forward(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                       CudaStream* cs) const;
  absl::Status Backward(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                        CudaStream* cs) const;
  absl::Status StoreGradHidden(const ShardProblem& shard, const float* partial, ShardChunk chunk,
                               void* grad_hidden, CudaStream* cs) const;

 private:
  absl::Status Validate(const ShardProblem& shard, const ShardArguments& args,
                        const ShardChunk* chunk, const CudaStream* cs) const;
  Layout LayoutFor(const ShardProblem& shard, int64_t chunk) const;
  size_t PlanBytes(const ShardProblem& shard, int64_t chunk) const;
  int64_t ChunkRows(const ShardProblem& shard, size_t bytes) const;
  template <typename TIn, typename TL>
  absl::Status ForwardTyped(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                            const Layout& layout, CudaStream& cs) const;
  template <typename TIn, typename TL>
  absl::Status BackwardTyped(const ShardProblem& shard, const ShardArguments& args,
                             ShardChunk chunk, const Layout& layout, CudaStream& cs) const;

  const int device_;
  const CudaBackendOptions options_;
};

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SHARD_CALLS_H_
