#include "server/engine/head_optimizer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/host_tensors.h"

namespace losshead::server {

absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& spec) {
  switch (spec.kind()) {
    case v1::OPTIMIZER_NONE:
    case v1::OPTIMIZER_ADAMW:
    case v1::OPTIMIZER_SGD:
    case v1::OPTIMIZER_LION:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.kind ", static_cast<int>(spec.kind()), " is not known"));
  }
  if (spec.momentum_buffer() && spec.kind() != v1::OPTIMIZER_SGD) {
    return absl::InvalidArgumentError("optimizer.momentum_buffer is for OPTIMIZER_SGD only");
  }
  return absl::OkStatus();
}

int StateBufferCount(const v1::OptimizerSpec& spec) {
  switch (spec.kind()) {
    case v1::OPTIMIZER_ADAMW:
      return kernels::StateBufferCount(kernels::OptimizerKind::kAdamW);
    case v1::OPTIMIZER_SGD:
      return spec.momentum_buffer() ? kernels::StateBufferCount(kernels::OptimizerKind::kSgd) : 0;
    case v1::OPTIMIZER_LION:
      return kernels::StateBufferCount(kernels::OptimizerKind::kLion);
    default:
      return 0;
  }
}

OptimizerFootprint OptimizerBytes(const v1::OptimizerSpec& spec, kernels::DType dtype,
                                  uint64_t count) {
  if (!HasOptimizer(spec)) return {};
  const uint64_t buffer = count * sizeof(float);
  return {.master = dtype == kernels::DType::kFP32 ? 0 : buffer,
          .state = static_cast<uint64_t>(StateBufferCount(spec)) * buffer};
}

absl::StatusOr<OptimizerBuffers> AllocateOptimizer(kernels::Backend& backend,
                                                   const v1::OptimizerSpec& spec,
                                                   kernels::DType dtype, uint64_t count) {
  OptimizerBuffers b;
  b.spec = spec;
  if (!HasOptimizer(spec)) return b;
  const OptimizerFootprint bytes = OptimizerBytes(spec, dtype, count);
  auto allocate = [&](uint64_t size, kernels::DeviceBuffer& out, const char* what) -> absl::Status {
    absl::StatusOr<kernels::DeviceBuffer> buffer = backend.Allocate(size);
    if (!buffer.ok()) return AsResourceExhausted(buffer.status(), what);
    out = std::move(*buffer);
    return absl::OkStatus();
  };
  if (bytes.master > 0) {
    if (absl::Status s = allocate(bytes.master, b.master, "the master weights"); !s.ok()) return s;
  }
  b.state.resize(StateBufferCount(spec));
  for (kernels::DeviceBuffer& state : b.state) {
    if (absl::Status s = allocate(count * sizeof(float), state, "the optimizer state"); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = allocate(sizeof(double), b.norm, "the gradient norm"); !s.ok()) return s;
  if (absl::Status s = allocate(sizeof(kernels::OptimizerCheck), b.check, "the step's check");
      !s.ok()) {
    return s;
  }
  return b;
}

absl::StatusOr<kernels::OptimizerOptions> KernelOptions(const OptimizerBuffers& buffers,
                                                        const v1::OptimizerHyperParams& p) {
  auto f = [](double x) { return static_cast<float>(x); };
  switch (buffers.spec.kind()) {
    case v1::OPTIMIZER_ADAMW:
      return kernels::AdamWOptions{.lr = f(p.lr()),
                                   .beta1 = f(p.beta1()),
                                   .beta2 = f(p.beta2()),
                                   .eps = f(p.eps()),
                                   .weight_decay = f(p.weight_decay())};
    case v1::OPTIMIZER_SGD:
      return kernels::SgdOptions{.lr = f(p.lr()),
                                 .momentum = f(p.momentum()),
                                 .dampening = f(p.dampening()),
                                 .nesterov = p.nesterov(),
                                 .weight_decay = f(p.weight_decay()),
                                 .init_momentum_buffer = !buffers.momentum_started};
    case v1::OPTIMIZER_LION:
      return kernels::LionOptions{.lr = f(p.lr()),
                                  .beta1 = f(p.beta1()),
                                  .beta2 = f(p.beta2()),
                                  .weight_decay = f(p.weight_decay())};
    default:
      return absl::FailedPreconditionError(
          "the head has no optimizer: create it with spec.optimizer or call SetOptimizer");
  }
}

absl::Status CheckOptimizerBuffers(const OptimizerBuffers& buffers,
                                   const kernels::OptimizerOptions& options) {
  // Only an exact 0 skips the buffer; NaN and negative momenta were refused before this, as
  // INVALID_ARGUMENT whatever the buffers.
  const auto* sgd = std::get_if<kernels::SgdOptions>(&options);
  if (sgd != nullptr && sgd->momentum != 0.0f && buffers.state.empty()) {
    return absl::FailedPreconditionError(
        "params.momentum needs the SGD momentum buffer: SetOptimizer with "
        "optimizer.momentum_buffer = true");
  }
  return absl::OkStatus();
}

kernels::OptimizerTensors KernelTensors(const OptimizerBuffers& buffers, void* weights,
                                        float* grad) {
  kernels::OptimizerTensors t{
      .weight = weights, .master = buffers.master.as<float>(), .grad = grad};
  switch (buffers.spec.kind()) {
    case v1::OPTIMIZER_ADAMW:
      t.exp_avg = buffers.state[0].as<float>();
      t.exp_avg_sq = buffers.state[1].as<float>();
      break;
    case v1::OPTIMIZER_SGD:
      if (!buffers.state.empty()) t.momentum_buffer = buffers.state[0].as<float>();
      break;
    case v1::OPTIMIZER_LION:
      t.exp_avg = buffers.state[0].as<float>();
      break;
    default:
      break;
  }
  return t;
}

}  // namespace losshead::server
