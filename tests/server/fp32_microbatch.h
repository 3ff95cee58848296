// A sum-reduced fp32 micro-batch for Head::Step with random hidden states and targets spread over
// the vocabulary, and the fp32 head it goes to: what the tests that drive a head through faults
// and cuts send.
#ifndef LOSSHEAD_TESTS_SERVER_FP32_MICROBATCH_H_
#define LOSSHEAD_TESTS_SERVER_FP32_MICROBATCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "server/engine/head.h"
#include "tests/server/test_util.h"

namespace losshead::server {

// An fp32 head "h" of v x d whose W is drawn from N(0, 0.5^2) with `seed`: the head they step.
inline v1::HeadSpec Fp32HeadSpec(int64_t v, int64_t d, uint64_t seed) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(seed);
  return spec;
}

// n x d hidden states drawn from `seed`; target i is (3 seed + 5 i) mod v. Head "h".
inline MicroBatch Fp32SumMicroBatch(int64_t n, int64_t d, int64_t v, uint64_t seed,
                                    const std::string& client_id, uint64_t sequence) {
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id(client_id);
  mb.header.set_sequence(sequence);
  mb.header.set_num_tokens(n);
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.header.mutable_loss_options()->set_reduction(v1::REDUCTION_SUM);
  mb.hidden = testing::Bytes(testing::RandomFloats(static_cast<size_t>(n * d), seed));
  std::vector<int32_t> y(n);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<int32_t>((seed * 3 + 5 * i) % v);
  mb.targets = testing::Bytes(y);
  return mb;
}

}  // namespace losshead::server

#endif  // LOSSHEAD_TESTS_SERVER_FP32_MICROBATCH_H_
