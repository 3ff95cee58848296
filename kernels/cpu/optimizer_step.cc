#include "kernels/cpu/optimizer_step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "kernels/common/optimizer_math.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels {
namespace {

using optim::StepScalars;

// Where the rounded image of the master goes: nowhere for fp32 weights (they are the master).
template <DType kDType>
void StoreRounded(void* weight, int64_t i, float p) {
  if constexpr (kDType == DType::kBF16) static_cast<uint16_t*>(weight)[i] = FloatToBf16(p);
  if constexpr (kDType == DType::kFP16) static_cast<uint16_t*>(weight)[i] = FloatToFp16(p);
}

template <typename Rule, DType kDType>
void StepRange(const StepScalars& s, const OptimizerTensors& t, float* a_state, float* b_state,
               int64_t begin, int64_t end) {
  float* param = kDType == DType::kFP32 ? static_cast<float*>(t.weight) : t.master;
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float a = a_state != nullptr ? a_state[i] : 0.0f;
    float b = b_state != nullptr ? b_state[i] : 0.0f;
    Rule::Apply(s, t.grad[i], p, a, b);
    param[i] = p;
    if (a_state != nullptr) a_state[i] = a;
    if (b_state != nullptr) b_state[i] = b;
    StoreRounded<kDType>(t.weight, i, p);
    t.grad[i] = 0.0f;
  }
}

template <typename Rule>
void Step(const OptimizerProblem& problem, const OptimizerTensors& t, float* a_state,
          float* b_state, ThreadPool& pool) {
  const StepScalars s = optim::MakeStepScalars(problem);
  pool.ParallelFor(problem.count, [&](int64_t begin, int64_t end) {
    switch (problem.dtype) {
      case DType::kFP32:
        return StepRange<Rule, DType::kFP32>(s, t, a_state, b_state, begin, end);
      case DType::kBF16:
        return StepRange<Rule, DType::kBF16>(s, t, a_state, b_state, begin, end);
      case DType::kFP16:
        return StepRange<Rule, DType::kFP16>(s, t, a_state, b_state, begin, end);
    }
  });
}

// Whether `p` rounds to a finite value of the weights' dtype.
template <DType kDType>
bool RoundsFinite(float p) {
  if constexpr (kDType == DType::kBF16) return std::isfinite(Bf16ToFloat(FloatToBf16(p)));
  if constexpr (kDType == DType::kFP16) return std::isfinite(Fp16ToFloat(FloatToFp16(p)));
  return std::isfinite(p);
}

// fmax leaves NaN out, as the CUDA check does.
void Merge(OptimizerCheck& into, const OptimizerCheck& part) {
  into.nonfinite += part.nonfinite;
  into.weight = std::fmax(into.weight, part.weight);
  into.state_a = std::fmax(into.state_a, part.state_a);
  into.state_b = std::fmax(into.state_b, part.state_b);
}

template <typename Rule, DType kDType>
OptimizerCheck CheckRange(const StepScalars& s, const OptimizerTensors& t, const float* a_state,
                          const float* b_state, int64_t begin, int64_t end) {
  const float* param = kDType == DType::kFP32 ? static_cast<const float*>(t.weight) : t.master;
  OptimizerCheck check;
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float a = a_state != nullptr ? a_state[i] : 0.0f;
    float b = b_state != nullptr ? b_state[i] : 0.0f;
    Rule::Apply(s, t.grad[i], p, a, b);
    const bool finite =
        std::isfinite(p) && RoundsFinite<kDType>(p) && std::isfinite(a) && std::isfinite(b);
    check.nonfinite += finite ? 0 : 1;
    check.weight = std::fmax(check.weight, std::abs(p));
    check.state_a = std::fmax(check.state_a, std::abs(a));
    check.state_b = std::fmax(check.state_b, std::abs(b));
  }
  return check;
}

template <typename Rule>
OptimizerCheck Check(const OptimizerProblem& problem, const OptimizerTensors& t,
                     const float* a_state, const float* b_state, ThreadPool& pool) {
  const StepScalars s = optim::MakeStepScalars(problem);
  std::mutex mu;
  OptimizerCheck total;
  pool.ParallelFor(problem.count, [&](int64_t begin, int64_t end) {
    OptimizerCheck part;
    switch (problem.dtype) {
      case DType::kFP32:
        part = CheckRange<Rule, DType::kFP32>(s, t, a_state, b_state, begin, end);
        break;
      case DType::kBF16:
        part = CheckRange<Rule, DType::kBF16>(s, t, a_state, b_state, begin, end);
        break;
      case DType::kFP16:
        part = CheckRange<Rule, DType::kFP16>(s, t, a_state, b_state, begin, end);
        break;
    }
    std::lock_guard<std::mutex> lock(mu);
    Merge(total, part);
  });
  return total;
}

}  // namespace

OptimizerCheck CpuCheckOptimizerStep(const OptimizerProblem& problem,
                                     const OptimizerTensors& tensors, ThreadPool& pool) {
  switch (KindOf(problem.options)) {
    case OptimizerKind::kAdamW:
      return Check<optim::AdamWRule>(problem, tensors, tensors.exp_avg, tensors.exp_avg_sq, pool);
    case OptimizerKind::kSgd: {
      const bool momentum = std::get<SgdOptions>(problem.options).momentum != 0.0f;
      return Check<optim::SgdRule>(problem, tensors, momentum ? tensors.momentum_buffer : nullptr,
                                   nullptr, pool);
    }
    case OptimizerKind::kLion:
      return Check<optim::LionRule>(problem, tensors, tensors.exp_avg, nullptr, pool);
  }
  return {};
}

void CpuOptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                      ThreadPool& pool) {
  switch (KindOf(problem.options)) {
    case OptimizerKind::kAdamW:
      return Step<optim::AdamWRule>(problem, tensors, tensors.exp_avg, tensors.exp_avg_sq, pool);
    case OptimizerKind::kSgd: {
      // Without momentum SGD keeps no state: the buffer, if any, is neither read nor written.
      const bool momentum = std::get<SgdOptions>(problem.options).momentum != 0.0f;
      return Step<optim::SgdRule>(problem, tensors, momentum ? tensors.momentum_buffer : nullptr,
                                  nullptr, pool);
    }
    case OptimizerKind::kLion:
      return Step<optim::LionRule>(problem, tensors, tensors.exp_avg, nullptr, pool);
  }
}

}  // namespace losshead::kernels
