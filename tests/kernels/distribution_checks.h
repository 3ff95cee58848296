// The checks of the distribution outputs (Arguments, problem.h) shared by the backend suites:
// against the float64 references, between two runs, and that asking for them changes nothing else.
//
// The near-tie rule: an argmax (or a top-k id list) must equal the float64 reference's, except on
// a token whose reference gap (ReferenceResult::per_token_top_gap for the argmax,
// ReferenceTopKResult::margin for the top-k) is <= tolerance.near_tie: there the fp32 (or bf16)
// logits may order the classes otherwise, and the id must only be one of the near-tied classes.
// An exact tie in float64 with logits exact in fp32 (integer inputs) is no near-tie: the lowest
// id must win. The correct count is checked against the argmax returned, and against the
// reference's within the near-ties.
#ifndef LOSSHEAD_TESTS_KERNELS_DISTRIBUTION_CHECKS_H_
#define LOSSHEAD_TESTS_KERNELS_DISTRIBUTION_CHECKS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/dtype_convert.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/reference_loss.h"
#include "tests/kernels/reference_topk.h"

namespace losshead::kernels::testing {

struct DistributionTolerance {
  double rel = 2e-6;       // logprob, entropy, top-k log-probs: rel |ref| + rel
  double near_tie = 1e-4;  // see the file comment
  // The most tokens (a share of N) whose argmax or top-k may be near-ties: beyond it the inputs
  // decide too little for the id checks to mean anything.
  double max_near_tie_share = 0.2;
};

inline bool SameFloatBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Every loss output of `with` (a call that asked for distribution outputs) is `without`'s, bit for
// bit.
inline void ExpectSameLossBits(const Outputs& with, const Outputs& without) {
  EXPECT_EQ(std::memcmp(&with.loss_sum, &without.loss_sum, sizeof(float)), 0)
      << with.loss_sum << " vs " << without.loss_sum;
  EXPECT_EQ(with.token_count, without.token_count);
  EXPECT_TRUE(SameFloatBits(with.per_token_loss, without.per_token_loss)) << "per_token_loss";
  EXPECT_TRUE(SameFloatBits(with.per_token_lse, without.per_token_lse)) << "per_token_lse";
  EXPECT_TRUE(SameFloatBits(with.grad_weight, without.grad_weight)) << "grad_weight";
  ASSERT_EQ(with.grad_hidden.size(), without.grad_hidden.size());
  for (size_t i = 0; i < with.grad_hidden.size(); ++i) {
    ASSERT_EQ(with.grad_hidden[i], without.grad_hidden[i]) << "grad_hidden[" << i << "]";
  }
}

// `got` asked for logprob, entropy, argmax and correct_count (and the top-k when `topk` is given)
// on `in`; `ref` and `topk` are the float64 references of the same inputs.
inline void ExpectDistributionMatchesReference(const Inputs& in, const Outputs& got,
                                               const ReferenceResult& ref,
                                               const ReferenceTopKResult* topk,
                                               const DistributionTolerance& tol) {
  const Problem& p = in.problem;
  ASSERT_EQ(got.per_token_logprob.size(), static_cast<size_t>(p.n));
  ASSERT_EQ(got.per_token_entropy.size(), static_cast<size_t>(p.n));
  ASSERT_EQ(got.per_token_argmax.size(), static_cast<size_t>(p.n));
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(got.per_token_logprob), ref.per_token_logprob, tol.rel, tol.rel),
      1.0)
      << "per_token_logprob";
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(got.per_token_entropy), ref.per_token_entropy, tol.rel, tol.rel),
      1.0)
      << "per_token_entropy";
  int64_t near_ties = 0, correct = 0;
  for (int64_t t = 0; t < p.n; ++t) {
    const int32_t argmax = got.per_token_argmax[t];
    if (in.targets[t] == p.options.ignore_index) {
      EXPECT_EQ(got.per_token_logprob[t], 0.0f) << "token " << t;
      EXPECT_EQ(got.per_token_entropy[t], 0.0f) << "token " << t;
      EXPECT_EQ(argmax, -1) << "token " << t;
      continue;
    }
    ASSERT_GE(argmax, 0) << "token " << t;
    ASSERT_LT(argmax, p.v) << "token " << t;
    correct += argmax == in.targets[t] ? 1 : 0;
    if (ref.per_token_top_gap[t] <= tol.near_tie) {
      ++near_ties;
      continue;
    }
    EXPECT_EQ(argmax, ref.per_token_argmax[t]) << "token " << t;
  }
  EXPECT_EQ(got.correct_count, correct);
  EXPECT_LE(std::abs(got.correct_count - ref.correct_count), near_ties);
  EXPECT_LE(near_ties, tol.max_near_tie_share * p.n)
      << "too many near-ties for the argmax check to mean anything";
  if (topk == nullptr) return;
  const TopKCheck check =
      CheckTopK(*topk, got.top_k_ids, got.top_k_logprobs, tol.rel, tol.near_tie);
  EXPECT_EQ(check.error, "");
  EXPECT_LE(check.near_ties, tol.max_near_tie_share * p.n)
      << "too many near-ties for the top-k check to mean anything";
  // The top-k's first is the argmax.
  for (int64_t t = 0; t < p.n; ++t) {
    EXPECT_EQ(got.top_k_ids[t * topk->k], got.per_token_argmax[t]) << "token " << t;
  }
}

// Two runs' distribution outputs (say CUDA and CPU, or sharded and whole) agree: values within
// tol.rel, ids equal except on the reference's near-ties.
inline void ExpectDistributionsAgree(const Inputs& in, const Outputs& a, const Outputs& b,
                                     const ReferenceResult& ref, const ReferenceTopKResult* topk,
                                     const DistributionTolerance& tol) {
  const Problem& p = in.problem;
  EXPECT_LE(WorstToleranceRatio(ToDouble(a.per_token_logprob), ToDouble(b.per_token_logprob),
                                tol.rel, tol.rel),
            1.0)
      << "per_token_logprob";
  EXPECT_LE(WorstToleranceRatio(ToDouble(a.per_token_entropy), ToDouble(b.per_token_entropy),
                                tol.rel, tol.rel),
            1.0)
      << "per_token_entropy";
  ASSERT_EQ(a.per_token_argmax.size(), b.per_token_argmax.size());
  for (int64_t t = 0; t < p.n; ++t) {
    if (ref.per_token_top_gap[t] <= tol.near_tie) continue;
    EXPECT_EQ(a.per_token_argmax[t], b.per_token_argmax[t]) << "token " << t;
  }
  if (topk == nullptr) return;
  ASSERT_EQ(a.top_k_ids.size(), b.top_k_ids.size());
  EXPECT_LE(
      WorstToleranceRatio(ToDouble(a.top_k_logprobs), ToDouble(b.top_k_logprobs), tol.rel, tol.rel),
      1.0)
      << "top_k_logprobs";
  for (int64_t t = 0; t < p.n; ++t) {
    if (topk->margin[t] <= tol.near_tie) continue;
    for (int i = 0; i < topk->k; ++i) {
      EXPECT_EQ(a.top_k_ids[t * topk->k + i], b.top_k_ids[t * topk->k + i])
          << "token " << t << " position " << i;
    }
  }
}

// Sets the targets of every other counted token to the reference's argmax, so that the correct
// count is not just 0 on random targets.
inline void AimEveryOtherTarget(Inputs& in) {
  const ReferenceResult ref = ReferenceLoss(in.problem, in.hidden, in.weight, in.targets);
  for (size_t t = 0; t < in.targets.size(); t += 2) {
    if (in.targets[t] != in.problem.options.ignore_index) in.targets[t] = ref.per_token_argmax[t];
  }
}

// Inputs whose logits are exact in fp32 whatever order a GEMM sums in: each token's hidden row is
// one-hot, so z_j is one weight, drawn from base (1 + m ulp) for base in {0.5, 1, 2} and m in
// {0, 1, 2}, ulp the dtype's relative step. Every token sees exact ties (the same value drawn
// twice) and near-ties one ulp apart, which float64 and the backend order alike.
inline Inputs LadderInputs(const Problem& p, uint64_t seed) {
  Inputs in = MakeRandomInputs(p, seed, InputSpec{.ignore_fraction = 0.2});
  const double ulp =
      p.dtype == DType::kBF16 ? 0x1p-7 : (p.dtype == DType::kFP16 ? 0x1p-10 : 0x1p-23);
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int64_t t = 0; t < p.n; ++t) {
    for (int64_t c = 0; c < p.d; ++c) in.hidden[t * p.d + c] = c == t % p.d ? 1.0 : 0.0;
  }
  for (double& w : in.weight) {
    const double base = 0.5 * static_cast<double>(1 << (next() % 3));
    w = base * (1.0 + static_cast<double>(next() % 3) * ulp);
  }
  std::vector<float> f(std::max(in.hidden.size(), in.weight.size()));
  auto encode = [&](const std::vector<double>& values, std::vector<uint8_t>& bytes) {
    for (size_t i = 0; i < values.size(); ++i) f[i] = static_cast<float>(values[i]);
    FromFloat(p.dtype, f.data(), bytes.data(), values.size());
  };
  encode(in.hidden, in.hidden_bytes);
  encode(in.weight, in.weight_bytes);
  return in;
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_DISTRIBUTION_CHECKS_H_
