#include "server/engine/head_bias.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/optimizer_step.h"
#include "kernels/cpu/thread_pool.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/host_tensors.h"

namespace losshead::server {

absl::Status AllocateBias(ReplicaGroup& group) {
  for (const auto& r : group.replicas()) {
    const size_t bytes = static_cast<size_t>(ReplicaGroup::DeviceRows(*r)) * sizeof(float);
    auto b = r->backend.Allocate(bytes);
    if (!b.ok()) return AsResourceExhausted(b.status(), "the output bias");
    r->bias = std::move(*b);
    auto g = r->backend.Allocate(bytes);
    if (!g.ok()) return AsResourceExhausted(g.status(), "the output bias's gradient accumulator");
    r->grad_bias = std::move(*g);
  }
  return ZeroGradBias(group);
}

absl::Status CopyBiasIn(ReplicaGroup& group, const std::vector<float>& values) {
  for (const auto& r : group.replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(r->bias.data(), values.data() + r->held.begin,
                                                     r->bias.bytes(), *r->stream));
  }
  return group.Synchronize();  // `values` may change once this returns
}

absl::StatusOr<std::vector<float>> ReadGradBias(ReplicaGroup& group) {
  std::vector<std::vector<float>> parts(group.size());
  for (const auto& r : group.replicas()) {
    parts[r->rank].resize(ReplicaGroup::DeviceRows(*r));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(parts[r->rank].data(), r->grad_bias.data(),
                                                   r->grad_bias.bytes(), *r->stream));
  }
  LOSSHEAD_RETURN_IF_ERROR(group.Synchronize());
  std::vector<float> sum(group.vocab_size(), 0.0f);
  for (const auto& r : group.replicas()) {
    const std::vector<float>& part = parts[r->rank];
    for (size_t i = 0; i < part.size(); ++i) sum[r->held.begin + i] += part[i];
  }
  return sum;
}

absl::Status ZeroGradBias(ReplicaGroup& group) {
  for (const auto& r : group.replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.Memset(r->grad_bias.data(), 0, r->grad_bias.bytes(), *r->stream));
  }
  return group.Synchronize();
}

absl::Status RestoreGradBias(ReplicaGroup& group, const std::vector<float>& grad) {
  LOSSHEAD_RETURN_IF_ERROR(ZeroGradBias(group));
  int64_t covered = 0;  // rows below this are in a lower rank's accumulator already
  for (const auto& r : group.replicas()) {
    const int64_t begin = std::max(covered, r->held.begin);
    if (begin >= r->held.end) continue;
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(
        r->grad_bias.as<float>() + (begin - r->held.begin), grad.data() + begin,
        static_cast<size_t>(r->held.end - begin) * sizeof(float), *r->stream));
    covered = r->held.end;
  }
  return group.Synchronize();
}

double SquaredNorm(const std::vector<float>& values) {
  double sum = 0;
  for (float v : values) sum += static_cast<double>(v) * v;
  return sum;
}

absl::Status StepBias(const kernels::OptimizerProblem& problem, double weight_decay,
                      const HeadBias& before, std::vector<float> grad, HeadBias* after) {
  if (!(std::isfinite(weight_decay) && weight_decay >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.bias_weight_decay must be finite and >= 0, got ", weight_decay));
  }
  kernels::OptimizerProblem own = problem;
  own.count = static_cast<int64_t>(before.values.size());
  own.dtype = kernels::DType::kFP32;  // b is its own master
  std::visit([&](auto& o) { o.weight_decay = static_cast<float>(weight_decay); }, own.options);
  *after = before;
  kernels::OptimizerTensors t;
  t.weight = after->values.data();
  t.grad = grad.data();
  std::vector<float*> state;
  for (std::vector<float>& s : after->optimizer_state) state.push_back(s.data());
  switch (kernels::KindOf(own.options)) {
    case kernels::OptimizerKind::kAdamW:
      t.exp_avg = state.at(0);
      t.exp_avg_sq = state.at(1);
      break;
    case kernels::OptimizerKind::kLion:
      t.exp_avg = state.at(0);
      break;
    case kernels::OptimizerKind::kSgd:
      t.momentum_buffer = state.empty() ? nullptr : state[0];
      break;
  }
  LOSSHEAD_RETURN_IF_ERROR(kernels::ValidateOptimizerStep(own, t));
  // V values: one thread steps them in microseconds.
  static kernels::ThreadPool* const pool = new kernels::ThreadPool(1);
  kernels::CpuOptimizerStep(own, t, *pool);
  auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  bool ok = finite(after->values);
  for (const std::vector<float>& s : after->optimizer_state) ok = ok && finite(s);
  if (!ok) {
    return absl::FailedPreconditionError(
        "this optimizer step would carry the output bias or its optimizer state past fp32's "
        "range; nothing was stepped: give a smaller lr or weight_decay, or pull with reset to "
        "drop the window");
  }
  return absl::OkStatus();
}

std::vector<float> BiasToFloat(kernels::DType dtype, const char* src, size_t count) {
  std::vector<float> out(count);
  kernels::ToFloat(dtype, src, out.data(), count);
  return out;
}

}  // namespace losshead::server
