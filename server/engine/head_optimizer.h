// A head's server-side optimizer, apart from the Head members that run it (optimizer_apply.cc):
// which buffers a spec needs and how large they are, the device buffers themselves, and the
// translation of a request's hyper-parameters into the kernels' options.
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_OPTIMIZER_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_OPTIMIZER_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/optimizer.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

// Device bytes an optimizer adds to a head of `count` weights of `dtype`.
struct OptimizerFootprint {
  uint64_t master = 0;  // the fp32 master copy: BF16 and FP16 heads only
  uint64_t state = 0;   // state buffers (see StateBufferCount)
  uint64_t total() const { return master + state; }
};

// INVALID_ARGUMENT for an unknown kind or a momentum buffer asked of anything but SGD.
absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& spec);
// True for a spec that holds an optimizer (kind other than NONE).
inline bool HasOptimizer(const v1::OptimizerSpec& spec) {
  return spec.kind() != v1::OPTIMIZER_NONE;
}
// fp32 state buffers of a validated spec: AdamW 2 (exp_avg, exp_avg_sq), SGD 1 with its
// momentum buffer and 0 without, Lion 1 (exp_avg), NONE 0. Checkpoints keep them in this order.
int StateBufferCount(const v1::OptimizerSpec& spec);
OptimizerFootprint OptimizerBytes(const v1::OptimizerSpec& spec, kernels::DType dtype,
                                  uint64_t count);

// What a head's optimizer holds on the device. Used under the head's compute lock.
struct OptimizerBuffers {
  v1::OptimizerSpec spec;                    // kind NONE: nothing below is allocated
  kernels::DeviceBuffer master;              // fp32 copy of W (BF16 and FP16 heads)
  std::vector<kernels::DeviceBuffer> state;  // StateBufferCount(spec), in its order
  kernels::DeviceBuffer norm;                // one double: Backend::SquaredNorm's result
  kernels::DeviceBuffer check;               // one kernels::OptimizerCheck
  uint64_t step = 0;                         // applies since the optimizer was set
  // SGD: the momentum buffer holds torch's momentum_buffer (false: torch's None, so the next
  // step with momentum initialises it).
  bool momentum_started = false;
  // The weights version at which master equals W. A push bumps the version without touching
  // master: the next apply sees the difference and takes master from W again.
  uint64_t master_version = 0;
  // Bounds on the magnitudes of master and state over this replica's rows, where known: set by
  // an apply (its check's exact maxima, or the bound that let it skip the check), dropped
  // whenever master or state is written another way (a push, a restore, a new optimizer). An
  // apply whose bound stays in range needs no check (kernels::StepMagnitudeBound).
  std::optional<kernels::OptimizerMagnitudes> magnitudes;
};

// Allocates the buffers of `spec` for `count` weights of `dtype` (contents undefined);
// RESOURCE_EXHAUSTED names the one that did not fit.
absl::StatusOr<OptimizerBuffers> AllocateOptimizer(kernels::Backend& backend,
                                                   const v1::OptimizerSpec& spec,
                                                   kernels::DType dtype, uint64_t count);

// The kernel options of one apply under `buffers` (kind, momentum state) from the request's
// hyper-parameters; FAILED_PRECONDITION when the head has no optimizer. Values are not checked
// here: kernels::ValidateOptimizerProblem does that, before CheckOptimizerBuffers.
absl::StatusOr<kernels::OptimizerOptions> KernelOptions(const OptimizerBuffers& buffers,
                                                        const v1::OptimizerHyperParams& params);

// FAILED_PRECONDITION when `options` (valid ones) need a buffer the head was set up without: an
// SGD momentum other than 0 without the momentum buffer.
absl::Status CheckOptimizerBuffers(const OptimizerBuffers& buffers,
                                   const kernels::OptimizerOptions& options);

// The kernel tensors of one step over `weights` (of `dtype`), `grad` and `buffers`.
kernels::OptimizerTensors KernelTensors(const OptimizerBuffers& buffers, void* weights,
                                        float* grad);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_OPTIMIZER_H_
