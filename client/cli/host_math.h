// Host-side numerics for the demo and the benchmark: random tensors, the teacher's sampling and
// entropy, and the optimizers that the demo runs on the client.
#ifndef LOSSHEAD_CLIENT_CLI_HOST_MATH_H_
#define LOSSHEAD_CLIENT_CLI_HOST_MATH_H_

#include <cstdint>
#include <random>
#include <vector>

namespace losshead::cli {

std::vector<float> RandomNormal(size_t count, float std, std::mt19937_64& rng);
std::vector<uint16_t> ToBf16(const std::vector<float>& values);

// For each of the N rows of `hidden` (N x D), samples a target from softmax(W h) with W (V x D),
// and returns the mean entropy (nats) of those distributions: the lowest mean cross-entropy any
// student can reach on this batch in expectation.
double SampleFromTeacher(const std::vector<float>& teacher, const std::vector<float>& hidden,
                         int64_t n, int64_t d, int64_t v, std::mt19937_64& rng,
                         std::vector<int32_t>* targets);

// Adam (Kingma & Ba) with bias correction; SGD when `adam` is false.
class Optimizer {
 public:
  Optimizer(size_t size, bool adam, float lr);
  // params -= update(grad)
  void Apply(const float* grad, float* params);
  void set_lr(float lr) { lr_ = lr; }

 private:
  bool adam_;
  float lr_;
  int64_t t_ = 0;
  std::vector<float> m_;
  std::vector<float> v_;
};

}  // namespace losshead::cli

#endif  // LOSSHEAD_CLIENT_CLI_HOST_MATH_H_
