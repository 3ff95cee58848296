// Test helpers shared by the backend suites: random rounded inputs, and one Run through the public
// Backend API (allocate, copy in, run, copy out) with every output brought back to the host.
#ifndef LOSSHEAD_TESTS_KERNELS_BACKEND_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_BACKEND_RUNNER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels::testing {

struct InputSpec {
  double hidden_scale = 1.0;     // H ~ U(-hidden_scale, hidden_scale)
  double weight_scale = 1.0;     // W ~ U(-weight_scale, weight_scale)
  double ignore_fraction = 0.0;  // share of targets set to ignore_index
};

// Inputs in the problem's dtype (`*_bytes`) and the same values decoded to double, so that a
// float64 reference sees exactly what the backend sees.
struct Inputs {
  Problem problem;
  std::vector<uint8_t> hidden_bytes;
  std::vector<uint8_t> weight_bytes;
  std::vector<double> hidden;
  std::vector<double> weight;
  std::vector<int32_t> targets;
};

Inputs MakeRandomInputs(const Problem& problem, uint64_t seed, const InputSpec& spec = {});

struct RunOptions {
  size_t workspace_budget = size_t{64} << 20;
  bool grad_hidden = true;
  bool grad_weight = true;
  bool per_token = true;
  // Distribution outputs (Arguments, problem.h) to ask for; each is null when false.
  bool logprob = false;
  bool entropy = false;
  bool argmax = false;
  bool correct_count = false;
  // > 0: asks for top_k_ids and top_k_logprobs with this top_k.
  int32_t top_k = 0;
  // With grad_weight: deferred dW (grad_stash.h), a stash of N tokens flushed into dW after the
  // call, instead of dW accumulated in the call.
  bool stash = false;
  // dW before the call (V x D); zeros when empty.
  std::vector<float> initial_grad_weight;
  // The loss terms' inputs (Arguments, problem.h): each given when not empty (bias: V, the
  // others: N).
  std::vector<float> bias;
  std::vector<float> token_weights;
  std::vector<float> old_logprob;
  std::vector<float> advantages;
  std::vector<float> ref_logprob;
  bool grad_bias = false;
  // db before the call (V); zeros when empty.
  std::vector<float> initial_grad_bias;
};

struct Outputs {
  float loss_sum = 0.0f;
  int64_t token_count = 0;
  std::vector<float> per_token_loss;
  std::vector<float> per_token_lse;
  // The distribution outputs asked for (empty, or 0 for correct_count, when not).
  std::vector<float> per_token_logprob;
  std::vector<float> per_token_entropy;
  std::vector<int32_t> per_token_argmax;
  int64_t correct_count = 0;
  std::vector<int32_t> top_k_ids;     // N x top_k when asked for
  std::vector<float> top_k_logprobs;  // N x top_k when asked for
  std::vector<double> grad_hidden;  // decoded from the problem's dtype
  std::vector<float> grad_weight;   // the accumulator after the call
  std::vector<float> grad_bias;     // the accumulator after the call, when asked for
};

// Runs `inputs` on `backend` with WorkspaceBytes(problem, workspace_budget) bytes of workspace.
// Output buffers start filled with a poison pattern, so anything not written shows up.
absl::StatusOr<Outputs> RunOnBackend(Backend& backend, const Inputs& inputs,
                                     const RunOptions& options = {});

// Largest |actual - expected| / (rel * |expected| + abs); <= 1 means within tolerance.
double WorstToleranceRatio(const std::vector<double>& actual, const std::vector<double>& expected,
                           double rel, double abs);
double MaxAbs(const std::vector<double>& values);

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& values) {
  return std::vector<double>(values.begin(), values.end());
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_BACKEND_RUNNER_H_
