// The result of one computed micro-batch, as the idempotency cache remembers and replays it.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "losshead/v1/losshead.pb.h"
#include "server/engine/result_pool.h"

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
  std::shared_ptr<ResultPool> pool;  // null: grad_hidden is freed as usual

  size_t bytes() const { return grad_hidden.size() + per_token_loss.size() + sizeof(*this); }
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_OUTCOME_H_
