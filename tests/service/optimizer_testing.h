// What the optimizer tests share: an independent float64 AdamW and SGD written from torch.optim's
// documented update rules (not from any backend), and helpers that fill a head's gradient window
// and read it back exactly as the server holds it.
#ifndef LOSSHEAD_TESTS_SERVICE_OPTIMIZER_TESTING_H_
#define LOSSHEAD_TESTS_SERVICE_OPTIMIZER_TESTING_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::testing {

// torch.optim.AdamW (amsgrad off) and torch.optim.SGD in float64 over flat parameters.
class RefOptimizer {
 public:
  RefOptimizer(v1::OptimizerKind kind, std::vector<double> params);
  // One step with gradient `grad` (already divided and clipped) and the request's params.
  void Step(const std::vector<double>& grad, const v1::OptimizerHyperParams& p);
  const std::vector<double>& params() const { return params_; }
  // A push: the parameters are replaced, the state and the step count are kept.
  void SetParams(std::vector<double> params) { params_ = std::move(params); }

 private:
  v1::OptimizerKind kind_;
  std::vector<double> params_;
  std::vector<double> exp_avg_;
  std::vector<double> exp_avg_sq_;
  std::vector<double> momentum_buffer_;  // empty: torch's None
  int64_t step_ = 0;
};

// torch.nn.utils.clip_grad_norm_'s coefficient over parameters of squared norm `squared_norm`.
double ClipCoefficient(double squared_norm, double max_norm);

// Steps `microbatches` random micro-batches of `tokens` tokens each (fp32, REDUCTION_SUM, client
// id `client_id`, sequences from `*sequence` + 1) into `head` (V x D), then reads dW without
// resetting it: the raw window the next apply will see.
absl::StatusOr<std::vector<float>> FillWindow(client::Client& client, const std::string& head,
                                              int64_t v, int64_t d, const std::string& client_id,
                                              uint64_t* sequence, int microbatches, int64_t tokens);

// W of `head` as fp32.
absl::StatusOr<std::vector<float>> Weights(client::Client& client, const std::string& head);

v1::ApplyOptimizerRequest ApplyRequest(const std::string& head, const std::string& client_id,
                                       uint64_t key, const v1::OptimizerHyperParams& params);
v1::OptimizerHyperParams AdamWParams(double lr, double weight_decay);
v1::OptimizerHyperParams SgdParams(double lr, double momentum, double dampening, bool nesterov,
                                   double weight_decay);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_OPTIMIZER_TESTING_H_
