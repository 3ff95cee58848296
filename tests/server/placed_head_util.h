// What the tests of heads spread over several devices (replicated_head_test.cc,
// sharded_head_test.cc) share: micro-batches of known content, host conversions, pulls and
// downloads, and elementwise comparison.
#ifndef LOSSHEAD_TESTS_SERVER_PLACED_HEAD_UTIL_H_
#define LOSSHEAD_TESTS_SERVER_PLACED_HEAD_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/server/test_util.h"

namespace losshead::server::testing {

inline constexpr int64_t kD = 24;
inline constexpr int32_t kIgnore = -100;

inline kernels::DType KernelDType(v1::DType dtype) {
  return dtype == v1::DTYPE_BF16 ? kernels::DType::kBF16 : kernels::DType::kFP32;
}

inline std::string Encode(const std::vector<float>& values, v1::DType dtype) {
  std::string out(values.size() * kernels::DTypeSize(KernelDType(dtype)), '\0');
  kernels::FromFloat(KernelDType(dtype), values.data(), out.data(), values.size());
  return out;
}

inline std::vector<float> Decode(absl::string_view bytes, v1::DType dtype) {
  std::vector<float> out(bytes.size() / kernels::DTypeSize(KernelDType(dtype)));
  kernels::ToFloat(KernelDType(dtype), bytes.data(), out.data(), out.size());
  return out;
}

// A micro-batch in the head's dtype, and the values the head sees (for the fp64 reference).
struct Sample {
  MicroBatch mb;
  std::vector<float> hidden;
  std::vector<int32_t> targets;
  int64_t tokens = 0;  // targets other than ignore_index
};

// n tokens of kD random hidden states; about a fifth of the targets ignored (all of them with
// `all_ignored`).
inline Sample MakeSample(int64_t n, int64_t v, v1::DType dtype, uint64_t seed,
                         const std::string& client, uint64_t sequence, bool all_ignored = false) {
  Sample s;
  s.mb.header.set_head("h");
  s.mb.header.set_client_id(client);
  s.mb.header.set_sequence(sequence);
  s.mb.header.set_num_tokens(n);
  s.mb.header.set_hidden_dtype(dtype);
  s.mb.header.set_target_dtype(v1::DTYPE_INT32);
  s.mb.hidden = Encode(RandomFloats(static_cast<size_t>(n * kD), seed), dtype);
  s.hidden = Decode(s.mb.hidden, dtype);
  std::mt19937_64 rng(seed * 7 + 3);
  s.targets.resize(n);
  for (int32_t& y : s.targets) {
    y = all_ignored || rng() % 5 == 0 ? kIgnore : static_cast<int32_t>(rng() % v);
    s.tokens += y != kIgnore;
  }
  s.mb.targets = Bytes(s.targets);
  return s;
}

// |got - want| <= tol * max(floor, |want|) elementwise; the first mismatches are reported.
template <typename T>
void ExpectClose(const std::vector<float>& got, const std::vector<T>& want, double tol,
                 const std::string& what, double floor = 1.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double b = static_cast<double>(want[i]);
    if (std::abs(got[i] - b) <= tol * std::max(floor, std::abs(b))) continue;
    ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << b;
    if (++reported == 5) return;
  }
}

struct Pulled {
  v1::GradientSummary summary;
  std::vector<float> values;
};

inline Pulled Pull(Head& head, bool reset) {
  auto g = head.PullGradient(v1::DTYPE_FP32, reset);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return {};
  return Pulled{g->summary, FromBytes<float>(g->data)};
}

inline std::string Weights(Head& head, v1::DType dtype = v1::DTYPE_UNSPECIFIED) {
  auto w = head.DownloadWeights(dtype);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? w->data : std::string();
}

}  // namespace losshead::server::testing

#endif  // LOSSHEAD_TESTS_SERVER_PLACED_HEAD_UTIL_H_
