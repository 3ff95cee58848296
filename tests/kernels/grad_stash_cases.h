// Cases shared by the backends' deferred-dW suites: sequences of micro-batches of one head (one
// W, assorted sizes and loss options) and the float64 dW that their stash must add up to.
#ifndef LOSSHEAD_TESTS_KERNELS_GRAD_STASH_CASES_H_
#define LOSSHEAD_TESTS_KERNELS_GRAD_STASH_CASES_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "losshead/kernels/problem.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/reference_loss.h"

namespace losshead::kernels::testing {

struct StashCase {
  std::string name;
  DType dtype = DType::kFP32;
  LossOptions options;
  double ignore_fraction = 0.0;
  int64_t v = 37;  // not a multiple of 16: rows of G have padding in the stash
  int64_t d = 24;
  std::vector<int64_t> sizes;  // tokens of each micro-batch, in order
  int64_t capacity = 16;       // stash tokens: smaller than the sum, so that it fills and flushes
  int min_flushes = 2;
  MatmulPrecision precision = MatmulPrecision::kHighest;
};

inline std::ostream& operator<<(std::ostream& os, const StashCase& c) { return os << c.name; }

inline std::vector<StashCase> StashCases(DType dtype) {
  const std::string t(DTypeName(dtype));
  std::vector<StashCase> cases;
  cases.push_back({.name = t + "_mean", .dtype = dtype, .sizes = {5, 9, 1, 13, 7, 16}});
  LossOptions sum{.reduction = Reduction::kSum, .grad_scale = 0.25f};
  cases.push_back({.name = t + "_sum_scaled_with_ignored",
                   .dtype = dtype,
                   .options = sum,
                   .ignore_fraction = 0.3,
                   .sizes = {8, 8, 3, 11, 4}});
  LossOptions every{.reduction = Reduction::kMean,
                    .grad_scale = 3.0f,
                    .label_smoothing = 0.1f,
                    .z_loss = 1e-3f,
                    .softcap = 5.0f};
  cases.push_back({.name = t + "_every_option",
                   .dtype = dtype,
                   .options = every,
                   .ignore_fraction = 0.2,
                   .sizes = {6, 2, 12, 9, 10}});
  // Micro-batches of only ignored tokens add nothing, in between ones that do.
  cases.push_back({.name = t + "_all_ignored_between",
                   .dtype = dtype,
                   .ignore_fraction = 1.0,
                   .sizes = {7, 7, 7},
                   .min_flushes = 1});
  return cases;
}

// The micro-batches of `c`, all on the first one's W.
inline std::vector<Inputs> MakeStashBatches(const StashCase& c, uint64_t seed) {
  std::vector<Inputs> batches;
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    const Problem p{.n = c.sizes[i],
                    .d = c.d,
                    .v = c.v,
                    .dtype = c.dtype,
                    .options = c.options,
                    .precision = c.precision};
    InputSpec spec{.hidden_scale = 1.0, .weight_scale = 0.5, .ignore_fraction = c.ignore_fraction};
    // A case whose every token is ignored but the middle one's: dW is that micro-batch's alone.
    if (c.ignore_fraction == 1.0 && i == 1) spec.ignore_fraction = 0.0;
    Inputs in = MakeRandomInputs(p, seed + 101 * i, spec);
    if (!batches.empty()) {
      in.weight_bytes = batches[0].weight_bytes;
      in.weight = batches[0].weight;
    }
    batches.push_back(std::move(in));
  }
  return batches;
}

// Every micro-batch's dW, summed in float64.
inline std::vector<double> ReferenceGradWeight(const std::vector<Inputs>& batches) {
  std::vector<double> sum;
  for (const Inputs& in : batches) {
    const ReferenceResult ref = ReferenceLoss(in.problem, in.hidden, in.weight, in.targets);
    if (sum.empty()) sum.assign(ref.grad_weight.size(), 0.0);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += ref.grad_weight[i];
  }
  return sum;
}

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_GRAD_STASH_CASES_H_
