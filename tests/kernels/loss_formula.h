// One token's loss and logit gradient evaluated through kernels/common/loss_math.h alone, on the
// host or on a CUDA device, and an independent long-double evaluation written straight from the
// definition in problem.h: the shared formula's tests (loss_formula_test.cc on the CPU,
// loss_formula_cuda_test.cc on a GPU) compare the two, and the device's evaluation with the host's.
#ifndef LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_H_
#define LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/common/loss_math.h"

namespace losshead::kernels::testing {

// One token: its logits x, target and loss options.
struct FormulaCase {
  std::vector<float> x;
  int target = 0;
  loss::Options options;  // label smoothing, z-loss, soft-cap (0 = off)
};

// `count` fresh cases from `seed`: V from 1 to 300, logits up to +-range (range up to 80, past
// the soft-cap and far from 0), each option on or off at random, the target anywhere in the row.
inline std::vector<FormulaCase> RandomFormulaCases(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<>(lo, hi)(rng);
  };
  std::vector<FormulaCase> cases(count);
  for (FormulaCase& c : cases) {
    const int v = 1 + static_cast<int>(rng() % 300);
    const double range = uniform(0.1, 80.0);
    c.x.resize(v);
    for (float& x : c.x) x = static_cast<float>(uniform(-range, range));
    c.target = static_cast<int>(rng() % v);
    c.options.label_smoothing = rng() % 2 ? static_cast<float>(uniform(0.0, 0.95)) : 0.0f;
    c.options.z_loss = rng() % 2 ? static_cast<float>(uniform(0.0, 1e-2)) : 0.0f;
    c.options.softcap = rng() % 2 ? static_cast<float>(uniform(1.0, 50.0)) : 0.0f;
  }
  return cases;
}

template <typename T>
struct FormulaResult {
  T lse;
  T loss;
};

// Through loss_math.h in T: float as the row kernel evaluates a row (fp32, smoothing term last),
// double as the CPU backend and the shard combination do. Writes dloss/dx_j to grad[0, v).
template <typename T>
LOSSHEAD_HD FormulaResult<T> EvaluateFormula(const float* x, int v, int target,
                                             const loss::Options& o, T* grad) {
  const loss::BasicSoftcap<T> cap = loss::BasicSoftcap<T>::Of(o.softcap);
  T max = -INFINITY;
  T sum_z = 0;
  for (int j = 0; j < v; ++j) {
    const T z = cap(static_cast<T>(x[j]));
    max = z > max ? z : max;
    sum_z += z;
  }
  T sum_exp = 0;
  for (int j = 0; j < v; ++j) sum_exp += loss::Exp(cap(static_cast<T>(x[j])) - max);
  const T lse = loss::Lse(max, sum_exp);
  const T vocab = static_cast<T>(v);
  const T z_target = cap(static_cast<T>(x[target]));
  T token_loss;
  if constexpr (std::is_same_v<T, float>) {
    token_loss = loss::TokenLossSmoothingLast(o, lse, z_target, sum_z, vocab);
  } else {
    token_loss = loss::TokenLoss(o, lse, z_target, sum_z, vocab);
  }
  const loss::BasicGradFactors<T> f = loss::GradFactorsOf(o, lse, vocab);
  for (int j = 0; j < v; ++j) {
    const T z = cap(static_cast<T>(x[j]));
    T g = loss::LogitGrad(f, loss::Exp(z - lse), j == target);
    if (cap.cap > T(0)) g *= loss::SoftcapSlope(z * cap.inv_cap);
    grad[j] = g;
  }
  return {lse, token_loss};
}

// The independent evaluation: problem.h's definition in long double, sharing nothing with
// loss_math.h. The soft-cap's derivative is taken as sech^2(x / cap), from x rather than from z.
struct IndependentResult {
  long double lse = 0;
  long double loss = 0;
  std::vector<long double> grad;
};

inline long double IndependentLoss(const std::vector<long double>& x, const FormulaCase& c,
                                   long double* lse_out = nullptr) {
  const long double cap = c.options.softcap;
  std::vector<long double> z(x.size());
  long double max = -INFINITY, mean = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    z[j] = cap > 0 ? cap * std::tanh(x[j] / cap) : x[j];
    max = std::fmax(max, z[j]);
    mean += z[j];
  }
  mean /= static_cast<long double>(x.size());
  long double sum = 0;
  for (long double zj : z) sum += std::exp(zj - max);
  const long double lse = max + std::log(sum);
  if (lse_out != nullptr) *lse_out = lse;
  const long double eps = c.options.label_smoothing;
  return (1 - eps) * (lse - z[c.target]) + eps * (lse - mean) + c.options.z_loss * lse * lse;
}

inline IndependentResult Independent(const FormulaCase& c) {
  const std::vector<long double> x(c.x.begin(), c.x.end());
  IndependentResult r;
  r.loss = IndependentLoss(x, c, &r.lse);
  const long double cap = c.options.softcap;
  const long double eps = c.options.label_smoothing;
  const long double v = static_cast<long double>(x.size());
  r.grad.resize(x.size());
  for (size_t j = 0; j < x.size(); ++j) {
    const long double z = cap > 0 ? cap * std::tanh(x[j] / cap) : x[j];
    const long double p = std::exp(z - r.lse);
    long double g = p * (1 + 2 * c.options.z_loss * r.lse) - eps / v -
                    (static_cast<int>(j) == c.target ? 1 - eps : 0);
    if (cap > 0) {
      const long double sech = 1 / std::cosh(x[j] / cap);
      g *= sech * sech;
    }
    r.grad[j] = g;
  }
  return r;
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_H_
