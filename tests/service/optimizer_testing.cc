#include "tests/service/optimizer_testing.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "tests/service/host_tensors.h"

namespace losshead::testing {

RefOptimizer::RefOptimizer(v1::OptimizerKind kind, std::vector<double> params)
    : kind_(kind),
      params_(std::move(params)),
      exp_avg_(params_.size(), 0.0),
      exp_avg_sq_(params_.size(), 0.0) {}

void RefOptimizer::Step(const std::vector<double>& grad, const v1::OptimizerHyperParams& p) {
  ++step_;
  const size_t n = params_.size();
  if (kind_ == v1::OPTIMIZER_ADAMW) {
    const double bc1 = 1 - std::pow(p.beta1(), static_cast<double>(step_));
    const double bc2 = 1 - std::pow(p.beta2(), static_cast<double>(step_));
    for (size_t i = 0; i < n; ++i) {
      params_[i] *= 1 - p.lr() * p.weight_decay();
      exp_avg_[i] += (grad[i] - exp_avg_[i]) * (1 - p.beta1());
      exp_avg_sq_[i] = p.beta2() * exp_avg_sq_[i] + (1 - p.beta2()) * grad[i] * grad[i];
      const double denom = std::sqrt(exp_avg_sq_[i]) / std::sqrt(bc2) + p.eps();
      params_[i] -= p.lr() / bc1 * exp_avg_[i] / denom;
    }
    return;
  }
  // SGD
  const bool start = momentum_buffer_.empty() && p.momentum() != 0;
  if (start) momentum_buffer_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    double d = grad[i] + p.weight_decay() * params_[i];
    if (p.momentum() != 0) {
      double& b = momentum_buffer_[i];
      b = start ? d : p.momentum() * b + (1 - p.dampening()) * d;
      d = p.nesterov() ? d + p.momentum() * b : b;
    }
    params_[i] -= p.lr() * d;
  }
}

double ClipCoefficient(double squared_norm, double max_norm) {
  return std::min(1.0, max_norm / (std::sqrt(squared_norm) + 1e-6));
}

absl::StatusOr<std::vector<float>> FillWindow(client::Client& client, const std::string& head,
                                              int64_t v, int64_t d, const std::string& client_id,
                                              uint64_t* sequence, int microbatches,
                                              int64_t tokens) {
  for (int i = 0; i < microbatches; ++i) {
    const uint64_t seq = ++*sequence;
    const HostBatch batch = MakeBatch(tokens, d, v, v1::DTYPE_FP32, seq * 7919 + 13);
    client::Microbatch mb = ToMicrobatch(head, client_id, seq, batch);
    mb.options.set_reduction(v1::REDUCTION_SUM);
    absl::StatusOr<client::StepResult> result = client.Step(mb);
    if (!result.ok()) return result.status();
  }
  absl::StatusOr<client::PulledGradient> pulled =
      client.PullGradient(head, v1::DTYPE_FP32, /*reset=*/false);
  if (!pulled.ok()) return pulled.status();
  return Decode(pulled->data, v1::DTYPE_FP32);
}

absl::StatusOr<std::vector<float>> Weights(client::Client& client, const std::string& head) {
  absl::StatusOr<client::DownloadedWeights> w = client.DownloadWeights(head, v1::DTYPE_FP32);
  if (!w.ok()) return w.status();
  return Decode(w->data, v1::DTYPE_FP32);
}

v1::ApplyOptimizerRequest ApplyRequest(const std::string& head, const std::string& client_id,
                                       uint64_t key, const v1::OptimizerHyperParams& params) {
  v1::ApplyOptimizerRequest r;
  r.set_head(head);
  r.set_client_id(client_id);
  r.set_step_key(key);
  *r.mutable_params() = params;
  return r;
}

v1::OptimizerHyperParams AdamWParams(double lr, double weight_decay) {
  v1::OptimizerHyperParams p;
  p.set_lr(lr);
  p.set_beta1(0.9);
  p.set_beta2(0.999);
  p.set_eps(1e-8);
  p.set_weight_decay(weight_decay);
  return p;
}

v1::OptimizerHyperParams SgdParams(double lr, double momentum, double dampening, bool nesterov,
                                   double weight_decay) {
  v1::OptimizerHyperParams p;
  p.set_lr(lr);
  p.set_momentum(momentum);
  p.set_dampening(dampening);
  p.set_nesterov(nesterov);
  p.set_weight_decay(weight_decay);
  return p;
}

}  // namespace losshead::testing
