// Helpers shared by the server tests: tensors as wire bytes, a naive fp32 reference, and a
// PinnedPool whose buffers come from the heap (what a receiver hands over, without a device).
#ifndef LOSSHEAD_TESTS_SERVER_TEST_UTIL_H_
#define LOSSHEAD_TESTS_SERVER_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/engine/pinned_pool.h"

namespace losshead::server::testing {

inline std::shared_ptr<PinnedPool> HeapPinnedPool(size_t max_idle_bytes = size_t{64} << 20) {
  return PinnedPool::Create(
      [](size_t bytes) -> absl::StatusOr<kernels::HostBuffer> {
        return kernels::HostBuffer(std::malloc(bytes), bytes, &std::free);
      },
      max_idle_bytes);
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <typename T>
std::vector<T> FromBytes(const std::string& s) {
  std::vector<T> v(s.size() / sizeof(T));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(T));
  return v;
}

inline std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Mean-reduced cross-entropy of H (N x D) against W (V x D): loss, dH, and dW.
struct Reference {
  double loss_sum = 0;
  int64_t tokens = 0;
  std::vector<double> grad_hidden;
  std::vector<double> grad_weight;
};

inline Reference ReferenceMean(const std::vector<float>& h, const std::vector<float>& w,
                               const std::vector<int32_t>& y, int64_t n, int64_t d, int64_t v,
                               int64_t ignore = -100) {
  Reference r;
  r.grad_hidden.assign(n * d, 0.0);
  r.grad_weight.assign(v * d, 0.0);
  for (int64_t t = 0; t < n; ++t) r.tokens += y[t] != ignore;
  for (int64_t t = 0; t < n; ++t) {
    if (y[t] == ignore) continue;
    std::vector<double> z(v);
    double mx = -1e300;
    for (int64_t j = 0; j < v; ++j) {
      double s = 0;
      for (int64_t k = 0; k < d; ++k) s += double(h[t * d + k]) * w[j * d + k];
      z[j] = s;
      mx = std::max(mx, s);
    }
    double sum = 0;
    for (double x : z) sum += std::exp(x - mx);
    const double lse = mx + std::log(sum);
    r.loss_sum += lse - z[y[t]];
    for (int64_t j = 0; j < v; ++j) {
      const double g = (std::exp(z[j] - lse) - (j == y[t])) / r.tokens;
      for (int64_t k = 0; k < d; ++k) {
        r.grad_hidden[t * d + k] += g * w[j * d + k];
        r.grad_weight[j * d + k] += g * h[t * d + k];
      }
    }
  }
  return r;
}

}  // namespace losshead::server::testing

#endif  // LOSSHEAD_TESTS_SERVER_TEST_UTIL_H_
