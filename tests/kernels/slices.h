// Where each rank's slice starts in a collective's buffer, and the buffer's length: the layout
// ReduceScatter and AllGather take, as the collective suites compute it for their references.
#ifndef LOSSHEAD_TESTS_KERNELS_SLICES_H_
#define LOSSHEAD_TESTS_KERNELS_SLICES_H_

#include <cstdint>
#include <vector>

namespace losshead::testing {

// Prefix sums of `counts`: offsets[r] = counts[0] + ... + counts[r-1].
inline std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
  return offsets;
}

inline int64_t Total(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_KERNELS_SLICES_H_
