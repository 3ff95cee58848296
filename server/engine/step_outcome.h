// The result of one computed micro-batch, as the idempotency cache remembers and replays it.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/request_fingerprint.h"
#include "server/engine/result_pool.h"
#include "server/engine/token_outputs.h"

namespace losshead::server {

struct StepOutcome {
  StepOutcome() = default;
  StepOutcome(const StepOutcome&) = default;
  StepOutcome& operator=(const StepOutcome&) = default;
  // dH goes back to the pool it came from once nothing (cache, responses in flight) needs it.
  ~StepOutcome() {
    if (pool != nullptr) pool->Give(std::move(grad_hidden));
  }

  double loss_sum = 0;
  int64_t token_count = 0;
  double loss = 0;
  uint64_t weights_version = 0;
  bool forward_only = false;  // never remembered for replay, so checkpoints need not carry it
  v1::DType grad_hidden_dtype = v1::DTYPE_UNSPECIFIED;
  std::string grad_hidden;     // empty when skip_grad_hidden
  std::string per_token_loss;  // fp32; empty unless asked for (or reduction NONE)
  // The asked token outputs (TokenOutput order), 4 bytes a token each; empty where not asked.
  std::array<std::string, kTokenOutputs> token_outputs;
  // The top-k (StepOptions.top_k): N x k int32 ids and N x k fp32 log-probs; empty where not
  // asked.
  std::string top_k_ids;
  std::string top_k_logprobs;
  std::optional<int64_t> correct_count;  // set when asked (return_correct_count)
  std::shared_ptr<ResultPool> pool;      // null: grad_hidden is freed as usual
  // What the micro-batch asked for, stamped when the outcome is remembered: a repeat of its key
  // must match it. Unset for outcomes restored from a checkpoint older than fingerprints (format
  // <= 2): a repeat of one replays unchecked, as before.
  std::optional<StepFingerprint> fingerprint;
  // Not OK for a micro-batch that may be in dW but has no result (the device failed after its run
  // began): the answer of every repeat of its key, which is never computed again.
  absl::Status failure;
  // The loss the run computed (its resolved options), for the metrics of a computed micro-batch;
  // not kept in checkpoints: a replay counts nothing.
  bool policy_gradient = false;  // LossKind: policy gradient (else cross-entropy)
  bool entropy_term = false;     // entropy_coef != 0
  bool kl_term = false;          // kl_coef > 0

  const std::string& token_output(TokenOutput output) const {
    return token_outputs[static_cast<int>(output)];
  }
  // The tensors an answer sends: dH, per-token losses, token outputs and the top-k.
  size_t payload_bytes() const {
    size_t total =
        grad_hidden.size() + per_token_loss.size() + top_k_ids.size() + top_k_logprobs.size();
    for (const std::string& t : token_outputs) total += t.size();
    return total;
  }

  size_t bytes() const {
    return payload_bytes() + sizeof(*this) +
           (fingerprint.has_value() ? fingerprint->shape.size() : 0) + failure.message().size();
  }
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_
