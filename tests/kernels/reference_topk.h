// The float64 top-k of p = softmax(z) (Arguments::top_k_ids, top_k_logprobs, problem.h), written
// straight from its definition: a full sort of each token's z, larger first, lower id among equals.
// And the check every backend's top-k is held to against it, with its near-tie rule.
#ifndef LOSSHEAD_TESTS_KERNELS_REFERENCE_TOPK_H_
#define LOSSHEAD_TESTS_KERNELS_REFERENCE_TOPK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "losshead/kernels/problem.h"

namespace losshead::kernels::testing {

struct ReferenceTopKResult {
  int k = 0;
  std::vector<int32_t> ids;      // N x k; -1 for an ignored token
  std::vector<double> logprobs;  // N x k; 0 for an ignored token
  // N: the smallest gap > 0 between consecutive z of the sorted top k + 1 (Inf when none): where
  // it is small, fp32 logits may order those classes otherwise.
  std::vector<double> margin;
  std::vector<double> z;  // N x V, every token's z
  std::vector<bool> ignored;
};

// `hidden` and `weight` as ReferenceLoss takes them (already rounded to problem.dtype).
ReferenceTopKResult ReferenceTopK(const Problem& problem, const std::vector<double>& hidden,
                                  const std::vector<double>& weight,
                                  const std::vector<int32_t>& targets, int k);

// A backend's top-k against the reference:
// - log-probs: |got - ref| <= rel |ref| + rel at every position (the i-th largest z is what it is,
//   whichever of near-tied classes holds it);
// - ids: equal to the reference's, except on a token whose margin is <= near_tie, where each id
//   must be distinct and its reference z within near_tie of the reference's i-th z (a near-tie may
//   go either way; an exact tie in fp32 and in float64 alike must go to the lower id);
// - an ignored token: ids -1 and log-probs 0 exactly.
// `error` is empty when everything holds, else it describes the first failure.
struct TopKCheck {
  std::string error;
  int64_t near_ties = 0;   // tokens whose ids were allowed to differ
  int64_t exact_ties = 0;  // counted tokens with equal z among their reference top k
};
TopKCheck CheckTopK(const ReferenceTopKResult& ref, const std::vector<int32_t>& ids,
                    const std::vector<float>& logprobs, double rel, double near_tie);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_REFERENCE_TOPK_H_
