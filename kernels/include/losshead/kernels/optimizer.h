// The optimizer step over a head's weights: what one Backend::OptimizerStep computes, its
// hyper-parameters and the buffers it reads and writes, independent of the backend.
//
// An apply on a head runs, on the head's stream: Backend::SquaredNorm of the raw dW into a device
// double, a copy of it to the host and a synchronize; then, on the host, the clip coefficient from
// that norm divided by the window's token count (and the trunk's norm); then one
// Backend::OptimizerStep with grad_scale = clip_coef / tokens, which also zeroes dW. The head
// owns the buffers (OptimizerStateBytes says how much) and the step count.
#ifndef LOSSHEAD_KERNELS_OPTIMIZER_H_
#define LOSSHEAD_KERNELS_OPTIMIZER_H_

#include <cstdint>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// torch.optim.AdamW (amsgrad=False, maximize=False), per element with g = grad * grad_scale:
//   p *= 1 - lr * weight_decay
//   m  = lerp(m, g, 1 - beta1)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State: exp_avg (m) and exp_avg_sq (v), both zero before step 1.
struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

// torch.optim.SGD (maximize=False), per element with g = grad * grad_scale:
//   d = g + weight_decay * p                       (when weight_decay != 0)
//   b = init_momentum_buffer ? d : momentum * b + (1 - dampening) * d   (when momentum != 0)
//   d = nesterov ? d + momentum * b : b            (when momentum != 0)
//   p -= lr * d
// State: momentum_buffer (b), touched only when momentum != 0. `init_momentum_buffer` is torch's
// "momentum_buffer is None": set it on the first step that uses momentum (step 1 for an optimizer
// created with momentum) and keep it false afterwards; the caller stores that bit with the state.
struct SgdOptions {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  bool nesterov = false;
  float weight_decay = 0.0f;
  bool init_momentum_buffer = false;
};

// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), per element:
//   p *= 1 - lr * weight_decay
//   p -= lr * sign(beta1 * m + (1 - beta1) * g)     (sign(0) = 0)
//   m  = beta2 * m + (1 - beta2) * g
// State: exp_avg (m), zero before step 1.
struct LionOptions {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
};

// Which optimizer runs, with its hyper-parameters (given with every step, so that schedules stay
// with the caller).
using OptimizerOptions = std::variant<AdamWOptions, SgdOptions, LionOptions>;

enum class OptimizerKind { kAdamW, kSgd, kLion };

OptimizerKind KindOf(const OptimizerOptions& options);
absl::string_view OptimizerKindName(OptimizerKind kind);  // "adamw" | "sgd" | "lion"

// fp32 state buffers of `count` elements that `kind` keeps: AdamW 2 (exp_avg, exp_avg_sq), SGD 1
// (momentum_buffer; a caller that never uses momentum may skip it), Lion 1 (exp_avg).
int StateBufferCount(OptimizerKind kind);

// Device bytes an optimizer adds to weights of `count` elements of `dtype`: the fp32 master copy
// (none for fp32 weights, which are their own master) plus StateBufferCount(kind) fp32 buffers.
uint64_t OptimizerStateBytes(OptimizerKind kind, DType dtype, int64_t count);

// One step over `count` elements (V x D, or any contiguous part of it such as a shard).
struct OptimizerProblem {
  int64_t count = 0;
  DType dtype = DType::kBF16;  // of the weights; master, grad and state are always fp32
  OptimizerOptions options;
  // Multiplies the raw accumulated gradient before anything else: 1 / tokens in the window, times
  // the clip coefficient (see Backend::SquaredNorm).
  float grad_scale = 1.0f;
  // 1-based number of this step, for AdamW's bias correction.
  int64_t step = 1;
};

// Buffers of one step, each `count` elements in the backend's memory, none overlapping another.
struct OptimizerTensors {
  // `dtype` weights, overwritten with the master rounded to nearest-even (for fp32 they are the
  // master, updated in place).
  void* weight = nullptr;
  // fp32 master weights, read and updated. Required for bf16/fp16 weights; must be null for fp32.
  float* master = nullptr;
  // fp32 gradient accumulator (dW), read and then zeroed.
  float* grad = nullptr;
  float* exp_avg = nullptr;          // AdamW, Lion
  float* exp_avg_sq = nullptr;       // AdamW
  float* momentum_buffer = nullptr;  // SGD when momentum != 0
};

// Upper bounds of the magnitudes in one step's buffers over the elements it covers: |master|
// (the weights themselves when fp32), |state a| (exp_avg or momentum_buffer) and |exp_avg_sq|.
struct OptimizerMagnitudes {
  double weight = 0;
  double state_a = 0;
  double state_b = 0;
};

// An upper bound of the magnitudes after one step of `problem` (valid: ValidateOptimizerProblem)
// from buffers within `before`, when every raw gradient element (before grad_scale) is within
// `grad_abs`. It allows for the fp32 rounding of every operation; +Inf where an fp32
// intermediate of the rule could overflow. It needs no memory: the caller decides from it whether
// CheckOptimizerStep must run (see StepStaysInRange).
OptimizerMagnitudes StepMagnitudeBound(const OptimizerProblem& problem,
                                       const OptimizerMagnitudes& before, double grad_abs);

// True when every value within `after` is finite in fp32 and the weights round to finite values
// of `dtype` (fp16: |w| <= 65504; bf16: <= 3.3895314e38).
bool StepStaysInRange(DType dtype, const OptimizerMagnitudes& after);

// What Backend::CheckOptimizerStep finds, written to the backend's memory.
struct OptimizerCheck {
  // Elements whose new master, rounded weight or state would not be finite.
  uint32_t nonfinite = 0;
  // The largest magnitudes of the new values (NaN left out): exact bounds when nonfinite is 0.
  float weight = 0;
  float state_a = 0;
  float state_b = 0;
};

// Checks the problem without touching memory: INVALID_ARGUMENT naming the offending field when
// count < 1, step < 1, grad_scale is not finite, lr is negative or not finite, a beta is outside
// [0, 1) (Lion: [0, 1]), eps is not positive and finite, weight_decay is negative or not finite,
// momentum is negative or not finite, dampening is not finite, or nesterov is asked for without
// momentum or with dampening (torch's rule). Callers may run it before committing to a step.
absl::Status ValidateOptimizerProblem(const OptimizerProblem& problem);

// ValidateOptimizerProblem, then the buffers: INVALID_ARGUMENT when a required pointer is null,
// master is given for fp32 weights, or two buffers overlap.
absl::Status ValidateOptimizerStep(const OptimizerProblem& problem,
                                   const OptimizerTensors& tensors);

// The arguments of Backend::SquaredNorm: INVALID_ARGUMENT for count < 0, a null result, or null
// data with count > 0.
absl::Status ValidateSquaredNorm(const float* data, int64_t count, const double* result);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_OPTIMIZER_H_
