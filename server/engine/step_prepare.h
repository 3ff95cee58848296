// A micro-batch's preparation, before it reaches any device: its header and payload validated
// (INVALID_ARGUMENT), targets and hidden states converted to what the kernels take, its loss
// options resolved against the head's defaults. What the header alone decides is checked on its own
// (PrepareHeader), before any data arrives.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_PREPARE_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_PREPARE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/micro_batch.h"
#include "losshead/kernels/step_bound.h"
#include "server/engine/token_inputs.h"
#include "server/engine/token_outputs.h"

namespace losshead::server {

// What a prepared micro-batch carries to the devices: every field is valid once PrepareStep
// returns it, and nothing in it refers to the head.
struct PreparedStep {
  kernels::Problem problem;
  // N x D in the head's dtype: the request's own bytes when they arrived in it, else `converted`.
  std::optional<absl::string_view> request_hidden;
  // The request's bytes are page-locked (MicroBatch::pinned_hidden): copied to the device as
  // they are.
  bool request_pinned = false;
  std::string converted;
  absl::string_view hidden() const { return request_hidden ? *request_hidden : converted; }
  // The global shard whose device alone stages the hidden states, the run broadcasting them to
  // every other shard (a head sharded across processes: the first shard of the micro-batch's
  // origin); -1 where every device stages its own copy. With MicroBatch::hidden_elsewhere, no
  // device of this process stages them (hidden() is empty).
  int hidden_root = -1;
  bool hidden_elsewhere = false;
  // Nobody here reads the results (a process other than the origin): dH and the outputs are
  // computed as everywhere (the exchanges pair up) but not copied back.
  bool results_unread = false;
  std::vector<int32_t> targets;
  bool want_grad_hidden = true;
  kernels::DType grad_hidden_dtype = kernels::DType::kFP32;
  // MicroBatch::grad_hidden_to and its room: where dH goes as well, device to device.
  void* grad_hidden_to = nullptr;
  size_t grad_hidden_to_bytes = 0;
  bool want_per_token = false;
  TokenOutputs outputs;  // the token outputs and accuracy asked for
  // The per-token inputs of the loss terms (fp32, laid out as token_inputs.h says), finite at
  // every counted token, and their bounds over the counted tokens (for the overflow guard).
  TokenInputValues inputs;
  kernels::TermInputBounds input_bounds;
  std::optional<uint64_t> expected_version;
  bool forward_only = false;  // no dW, no counters, no idempotency (evaluation)
  kernels::DType hidden_dtype = kernels::DType::kFP32;  // as sent
  double hidden_abs = 0;       // the largest |h| in the head's dtype (finite)
  int64_t counted_tokens = 0;  // targets that are not ignore_index
  int64_t ignore_index = 0;    // as resolved; problem.options has its int32 image
};

// What of a head a micro-batch is prepared against; `backend` (any of the head's devices: they are
// of one kind and answer the same) tells whether it can run the problem.
struct StepTarget {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  kernels::DType dtype = kernels::DType::kFP32;
  kernels::MatmulPrecision precision = kernels::MatmulPrecision::kHighest;
  const kernels::Backend* backend = nullptr;
};

// The header's part: the codes a step answers for num_tokens < 1, a bad dtype or option (a bad
// token output too), or a problem the backend cannot run (INVALID_ARGUMENT), against the head's
// default loss options.
absl::Status PrepareHeader(const v1::StepHeader& header, const StepTarget& head,
                           const v1::LossOptions& defaults, PreparedStep* prepared);
// The whole micro-batch: the header's part, then sizes, targets in range, hidden finite (and
// finite in the head's dtype once converted), the token inputs' sizes and, at counted tokens,
// their values finite.
absl::StatusOr<PreparedStep> PrepareStep(const MicroBatch& microbatch, const StepTarget& head,
                                         const v1::LossOptions& defaults);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_PREPARE_H_
