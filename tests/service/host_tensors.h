// Test data on the host: random tensors rounded to a wire dtype, their encodings, micro-batches
// built from them, and the element-wise comparison used against the reference.
#ifndef LOSSHEAD_TESTS_SERVICE_HOST_TENSORS_H_
#define LOSSHEAD_TESTS_SERVICE_HOST_TENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::testing {

// Values exactly representable in `dtype` (so host and server hold the same numbers).
std::vector<float> RandomValues(size_t count, double std, v1::DType dtype, uint64_t seed);
client::Bytes Encode(const std::vector<float>& values, v1::DType dtype);
std::vector<float> Decode(const client::Bytes& bytes, v1::DType dtype);

// A micro-batch's tensors. Every `ignore_every`-th target (if > 0) is `ignore_index`.
struct HostBatch {
  int64_t n = 0;
  v1::DType dtype = v1::DTYPE_FP32;
  std::vector<float> hidden;  // N x D, exact in dtype
  client::Bytes hidden_bytes;
  std::vector<int64_t> targets;
  v1::DType target_dtype = v1::DTYPE_INT32;
  client::Bytes target_bytes;
};
HostBatch MakeBatch(int64_t n, int64_t d, int64_t v, v1::DType dtype, uint64_t seed,
                    int ignore_every = 0, int64_t ignore_index = -100,
                    v1::DType target_dtype = v1::DTYPE_INT32);
void SetTargets(HostBatch& batch, std::vector<int64_t> targets);

// A Microbatch that points into `batch` (which must outlive its sending).
client::Microbatch ToMicrobatch(const std::string& head, const std::string& client_id,
                                uint64_t sequence, const HostBatch& batch);

// Per-dtype tolerances: inputs are exact on both sides, so only the server's arithmetic (fp32)
// and the rounding of outputs to the dtype (dH in bf16) separate it from the reference.
struct Tolerance {
  double loss_rel;  // relative error of loss, loss_sum
  double grad;      // element error allowed, as a fraction of the tensor's largest magnitude
};
Tolerance ToleranceFor(v1::DType dtype);

// Every |got - want| <= tol * max|want| (+ a floor for all-zero tensors).
::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<double>& want,
                                    double tol);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_HOST_TENSORS_H_
