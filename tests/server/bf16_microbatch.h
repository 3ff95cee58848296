// A bf16 micro-batch for Head::Step from host values, as the engine receives one: header, hidden
// states rounded to bf16, int32 targets. Shared by the tests that build their own inputs.
#ifndef LOSSHEAD_TESTS_SERVER_BF16_MICROBATCH_H_
#define LOSSHEAD_TESTS_SERVER_BF16_MICROBATCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"

namespace losshead::server {

// `hidden` is targets.size() x D floats, row-major.
inline MicroBatch Bf16MicroBatch(const std::string& head, const std::string& client_id,
                                 uint64_t sequence, const std::vector<float>& hidden,
                                 const std::vector<int32_t>& targets) {
  const int64_t n = static_cast<int64_t>(targets.size());
  MicroBatch mb;
  mb.header.set_head(head);
  mb.header.set_client_id(client_id);
  mb.header.set_sequence(sequence);
  mb.header.set_num_tokens(n);
  mb.header.set_hidden_dtype(v1::DTYPE_BF16);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden.resize(hidden.size() * 2);
  kernels::FromFloat(kernels::DType::kBF16, hidden.data(), mb.hidden.data(), hidden.size());
  mb.targets.assign(reinterpret_cast<const char*>(targets.data()), n * sizeof(int32_t));
  return mb;
}

}  // namespace losshead::server

#endif  // LOSSHEAD_TESTS_SERVER_BF16_MICROBATCH_H_
