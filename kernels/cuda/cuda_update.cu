// The CUDA backend's single-pass updates: the gradient norm (squared_norm.cu) and the optimizer
// step and its check (optimizer_step.cu), their per-element math shared with the CPU backend.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <mutex>

#include "absl/status/status.h"
#include "kernels/common/optimizer_math.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/optimizer_step.cuh"
#include "kernels/cuda/squared_norm.cuh"

namespace losshead::kernels::cuda {

absl::Status CudaBackend::SquaredNorm(const float* data, int64_t count, double* result,
                                      Stream& stream) {
  if (absl::Status s = ValidateSquaredNorm(data, count, result); !s.ok()) return s;
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return LaunchSquaredNorm(data, count, cs->norm_partials(), result, cs->stream());
}

absl::Status CudaBackend::OptimizerStep(const OptimizerProblem& problem,
                                        const OptimizerTensors& tensors, Stream& stream) {
  if (absl::Status s = ValidateOptimizerStep(problem, tensors); !s.ok()) return s;
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  const OptimizerKind kind = KindOf(problem.options);
  const optim::StepScalars scalars = optim::MakeStepScalars(problem);
  float* state_a = tensors.exp_avg;
  if (kind == OptimizerKind::kSgd) {
    state_a = scalars.sgd_momentum ? tensors.momentum_buffer : nullptr;
  }
  float* state_b = kind == OptimizerKind::kAdamW ? tensors.exp_avg_sq : nullptr;
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  switch (problem.dtype) {
    case DType::kFP32:
      return LaunchOptimizerStep<float>(kind, scalars, static_cast<float*>(tensors.weight), nullptr,
                                        tensors.grad, state_a, state_b, problem.count,
                                        cs->stream());
    case DType::kBF16:
      return LaunchOptimizerStep(kind, scalars, tensors.master,
                                 static_cast<__nv_bfloat16*>(tensors.weight), tensors.grad, state_a,
                                 state_b, problem.count, cs->stream());
    case DType::kFP16:
      return LaunchOptimizerStep(kind, scalars, tensors.master,
                                 static_cast<__half*>(tensors.weight), tensors.grad, state_a,
                                 state_b, problem.count, cs->stream());
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::Status CudaBackend::CheckOptimizerStep(const OptimizerProblem& problem,
                                             const OptimizerTensors& tensors,
                                             OptimizerCheck* result, Stream& stream) {
  if (absl::Status s = ValidateOptimizerStep(problem, tensors); !s.ok()) return s;
  if (result == nullptr) return absl::InvalidArgumentError("result must not be null");
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  const OptimizerKind kind = KindOf(problem.options);
  const optim::StepScalars scalars = optim::MakeStepScalars(problem);
  // The buffers OptimizerStep would read, chosen the same way.
  const float* state_a = tensors.exp_avg;
  if (kind == OptimizerKind::kSgd) {
    state_a = scalars.sgd_momentum ? tensors.momentum_buffer : nullptr;
  }
  const float* state_b = kind == OptimizerKind::kAdamW ? tensors.exp_avg_sq : nullptr;
  const float* param =
      problem.dtype == DType::kFP32 ? static_cast<const float*>(tensors.weight) : tensors.master;
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  switch (problem.dtype) {
    case DType::kFP32:
      return LaunchOptimizerCheck<float>(kind, scalars, param, tensors.grad, state_a, state_b,
                                         problem.count, result, cs->stream());
    case DType::kBF16:
      return LaunchOptimizerCheck<__nv_bfloat16>(kind, scalars, param, tensors.grad, state_a,
                                                 state_b, problem.count, result, cs->stream());
    case DType::kFP16:
      return LaunchOptimizerCheck<__half>(kind, scalars, param, tensors.grad, state_a, state_b,
                                          problem.count, result, cs->stream());
  }
  return absl::InvalidArgumentError("unknown dtype");
}

}  // namespace losshead::kernels::cuda
