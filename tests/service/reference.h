// An independent float64 fused linear + cross-entropy, written from the loss definition in the
// proto and kernels/problem.h rather than from any backend: the oracle of the service tests.
#ifndef LOSSHEAD_TESTS_SERVICE_REFERENCE_H_
#define LOSSHEAD_TESTS_SERVICE_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "losshead/v1/losshead.pb.h"

namespace losshead::testing {

struct RefOptions {
  int64_t ignore_index = -100;
  v1::Reduction reduction = v1::REDUCTION_MEAN;  // UNSPECIFIED is not accepted here
  double grad_scale = 1.0;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
};

struct RefResult {
  double loss_sum = 0;
  int64_t token_count = 0;
  double loss = 0;
  std::vector<double> per_token_loss;  // N; 0 for ignored tokens
  std::vector<double> grad_hidden;     // N x D
  std::vector<double> grad_weight;     // V x D, this micro-batch's contribution to dW
};

// `weight` is V x D, `hidden` N x D (row-major, values as the server holds them), `targets` N.
RefResult Reference(const std::vector<float>& weight, const std::vector<float>& hidden,
                    const std::vector<int64_t>& targets, int64_t n, int64_t d, int64_t v,
                    const RefOptions& options);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_REFERENCE_H_
