#include "tests/kernels/reference_topk.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace losshead::kernels::testing {

ReferenceTopKResult ReferenceTopK(const Problem& problem, const std::vector<double>& hidden,
                                  const std::vector<double>& weight,
                                  const std::vector<int32_t>& targets, int k) {
  const int64_t n = problem.n, d = problem.d, v = problem.v;
  const double cap = problem.options.softcap;
  ReferenceTopKResult out;
  out.k = k;
  out.ids.assign(n * k, -1);
  out.logprobs.assign(n * k, 0.0);
  out.margin.assign(n, INFINITY);
  out.z.assign(n * v, 0.0);
  out.ignored.assign(n, false);
  std::vector<int32_t> order(v);
  for (int64_t t = 0; t < n; ++t) {
    double* z = &out.z[t * v];
    for (int64_t j = 0; j < v; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) dot += hidden[t * d + c] * weight[j * d + c];
      z[j] = cap > 0.0 ? cap * std::tanh(dot / cap) : dot;
    }
    out.ignored[t] = targets[t] == problem.options.ignore_index;
    if (out.ignored[t]) continue;
    const double zmax = *std::max_element(z, z + v);
    double sum = 0.0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - zmax);
    const double lse = zmax + std::log(sum);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return z[a] > z[b]; });
    for (int i = 0; i < k; ++i) {
      out.ids[t * k + i] = order[i];
      out.logprobs[t * k + i] = z[order[i]] - lse;
    }
    for (int i = 0; i < k && i + 1 < v; ++i) {
      const double gap = z[order[i]] - z[order[i + 1]];
      if (gap > 0.0) out.margin[t] = std::min(out.margin[t], gap);
    }
  }
  return out;
}

TopKCheck CheckTopK(const ReferenceTopKResult& ref, const std::vector<int32_t>& ids,
                    const std::vector<float>& logprobs, double rel, double near_tie) {
  TopKCheck check;
  const int k = ref.k;
  const int64_t n = static_cast<int64_t>(ref.margin.size());
  const int64_t v = n > 0 ? static_cast<int64_t>(ref.z.size()) / n : 0;
  if (ids.size() != static_cast<size_t>(n * k) || logprobs.size() != static_cast<size_t>(n * k)) {
    check.error =
        absl::StrCat("sizes ", ids.size(), " and ", logprobs.size(), ", expected ", n * k);
    return check;
  }
  for (int64_t t = 0; t < n && check.error.empty(); ++t) {
    const std::string at = absl::StrCat("token ", t, ": ");
    if (ref.ignored[t]) {
      for (int i = 0; i < k; ++i) {
        if (ids[t * k + i] != -1 || logprobs[t * k + i] != 0.0f) {
          check.error = absl::StrCat(at, "ignored, but position ", i, " is id ", ids[t * k + i],
                                     " log-prob ", logprobs[t * k + i]);
          break;
        }
      }
      continue;
    }
    const double* z = &ref.z[t * v];
    bool tied = false;
    for (int i = 0; i + 1 < k; ++i)
      tied = tied || z[ref.ids[t * k + i]] == z[ref.ids[t * k + i + 1]];
    check.exact_ties += tied ? 1 : 0;
    for (int i = 0; i < k; ++i) {
      const double want = ref.logprobs[t * k + i];
      const double got = logprobs[t * k + i];
      if (!(std::fabs(got - want) <= rel * std::fabs(want) + rel)) {
        check.error = absl::StrCat(at, "log-prob ", i, " is ", got, ", reference ", want);
        break;
      }
    }
    if (!check.error.empty()) break;
    bool same = true;
    for (int i = 0; i < k; ++i) same = same && ids[t * k + i] == ref.ids[t * k + i];
    if (same) continue;
    if (ref.margin[t] > near_tie) {
      check.error = absl::StrCat(at, "ids differ from the reference's at margin ", ref.margin[t]);
      break;
    }
    ++check.near_ties;
    for (int i = 0; i < k; ++i) {
      const int32_t id = ids[t * k + i];
      const bool unique = std::count(ids.begin() + t * k, ids.begin() + (t + 1) * k, id) == 1;
      if (id < 0 || id >= v || !unique || std::fabs(z[id] - z[ref.ids[t * k + i]]) > near_tie) {
        check.error = absl::StrCat(at, "near-tie, but id ", id, " at position ", i,
                                   " is not one of the tied classes");
        break;
      }
    }
  }
  return check;
}

}  // namespace losshead::kernels::testing
