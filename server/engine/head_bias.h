// A head's output bias b (HeadSpec.bias): the logits are logit_scale (h . w_j) + b_j. b is V fp32
// values whatever the head's dtype (it is its own master copy), held on the host by the head and
// copied to each device's rows (Replica::bias); each device's micro-batches add their db to its
// own accumulator (Replica::grad_bias) in their run, under the same compute locks as dW, so that
// db lives in exactly the gradient window dW does. What a cut does with db is done here on the
// host: V values are read and summed, stepped by the optimizer and written back, which costs
// nothing next to W's V x D.
//
// Invariants: every function here runs under the cut (every replica's compute lock); the rows a
// device holds of b are always b's (written by CopyBiasIn after every change); the window's db is
// the sum over replicas of their accumulators (ReadGradBias).
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_BIAS_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_BIAS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/optimizer.h"
#include "server/engine/replica_group.h"

namespace losshead::server {

// What a head with a bias holds on the host (under the cut).
struct HeadBias {
  std::vector<float> values;  // b, V
  // The optimizer's state of b: StateBufferCount(spec) buffers of V, in its order (AdamW's
  // exp_avg, exp_avg_sq; SGD's momentum buffer; Lion's exp_avg), zero when it is set.
  std::vector<std::vector<float>> optimizer_state;
};

// Allocates b and db on every replica, for its held rows, and zeroes db (RESOURCE_EXHAUSTED names
// which did not fit).
absl::Status AllocateBias(ReplicaGroup& group);
// b (V values) to every replica's rows; waits.
absl::Status CopyBiasIn(ReplicaGroup& group, const std::vector<float>& values);
// The window's db (V values): every replica's accumulator added into the rows it holds, in rank
// order; waits.
absl::StatusOr<std::vector<float>> ReadGradBias(ReplicaGroup& group);
// Zeroes every replica's db; waits.
absl::Status ZeroGradBias(ReplicaGroup& group);
// A window's db (V values) put back on the devices (a restore): each row into the first replica
// that holds it, every other accumulator zero; waits.
absl::Status RestoreGradBias(ReplicaGroup& group, const std::vector<float>& grad);

// Squared L2 norm of `values`, in fp64.
double SquaredNorm(const std::vector<float>& values);

// One optimizer step of b, on the host with the CPU kernel the CPU backend steps W with (so the
// rule and its fp32 arithmetic are W's): `problem` is W's apply (options, step, grad_scale) with
// weight_decay replaced by `weight_decay`; `grad` is db, raw (the step scales it). Writes the
// result to `after` (a copy of `before` stepped), leaving `before` as it is: FAILED_PRECONDITION
// when a new value of b or of its state is not finite, nothing changed. INVALID_ARGUMENT for a
// weight decay that is negative or not finite.
absl::Status StepBias(const kernels::OptimizerProblem& problem, double weight_decay,
                      const HeadBias& before, std::vector<float> grad, HeadBias* after);

// Converts `count` values of `dtype` at `src` to fp32.
std::vector<float> BiasToFloat(kernels::DType dtype, const char* src, size_t count);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_BIAS_H_
