#include "client/cli/host_math.h"

#include <algorithm>
#include <cmath>

#include "losshead/kernels/dtype_convert.h"

namespace losshead::cli {

std::vector<float> RandomNormal(size_t count, float std, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, std);
  std::vector<float> out(count);
  for (float& x : out) x = normal(rng);
  return out;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = kernels::FloatToBf16(values[i]);
  return out;
}

double SampleFromTeacher(const std::vector<float>& teacher, const std::vector<float>& hidden,
                         int64_t n, int64_t d, int64_t v, std::mt19937_64& rng,
                         std::vector<int32_t>* targets) {
  targets->resize(n);
  std::vector<double> logits(v);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double entropy_sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    const float* h = hidden.data() + t * d;
    double max_logit = -INFINITY;
    for (int64_t j = 0; j < v; ++j) {
      const float* w = teacher.data() + j * d;
      float dot = 0;
      for (int64_t k = 0; k < d; ++k) dot += w[k] * h[k];
      logits[j] = dot;
      max_logit = std::max(max_logit, logits[j]);
    }
    double z = 0;
    double weighted = 0;  // sum p_j * logit_j, unnormalised
    for (int64_t j = 0; j < v; ++j) {
      const double e = std::exp(logits[j] - max_logit);
      z += e;
      weighted += e * (logits[j] - max_logit);
      logits[j] = e;  // reuse as unnormalised probabilities
    }
    // H = log Z - E[logit - max]
    entropy_sum += std::log(z) - weighted / z;
    double u = uniform(rng) * z;
    int64_t pick = v - 1;
    for (int64_t j = 0; j < v; ++j) {
      u -= logits[j];
      if (u <= 0) {
        pick = j;
        break;
      }
    }
    (*targets)[t] = static_cast<int32_t>(pick);
  }
  return entropy_sum / static_cast<double>(n);
}

Optimizer::Optimizer(size_t size, bool adam, float lr) : adam_(adam), lr_(lr) {
  if (adam_) {
    m_.assign(size, 0.0f);
    v_.assign(size, 0.0f);
  } else {
    m_.resize(size);
  }
}

void Optimizer::Apply(const float* grad, float* params) {
  const size_t size = m_.size();
  if (!adam_) {
    for (size_t i = 0; i < size; ++i) params[i] -= lr_ * grad[i];
    return;
  }
  constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f;
  ++t_;
  const float c1 = 1.0f - std::pow(kBeta1, static_cast<float>(t_));
  const float c2 = 1.0f - std::pow(kBeta2, static_cast<float>(t_));
  for (size_t i = 0; i < size; ++i) {
    m_[i] = kBeta1 * m_[i] + (1 - kBeta1) * grad[i];
    v_[i] = kBeta2 * v_[i] + (1 - kBeta2) * grad[i] * grad[i];
    params[i] -= lr_ * (m_[i] / c1) / (std::sqrt(v_[i] / c2) + kEps);
  }
}

}  // namespace losshead::cli
