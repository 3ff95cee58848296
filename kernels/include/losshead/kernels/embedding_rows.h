// Checks shared by Backend::GatherRows and Backend::IndexAddRows (backend.h), the two device calls
// behind a head that also serves its model's tied input embedding: the rows of W for a batch of
// token ids, and the gradient of those rows added into the fp32 dW accumulator.
//
// Both validate their sizes and pointers here (INVALID_ARGUMENT, nothing launched) before any
// work. The ids themselves are device memory and are not read by these checks: a caller checks
// them on the host (CheckRowIds) before it copies them to the device.
#ifndef LOSSHEAD_KERNELS_EMBEDDING_ROWS_H_
#define LOSSHEAD_KERNELS_EMBEDDING_ROWS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// n >= 0, d >= 1, rows >= 1, dtype a float dtype, and non-null pointers where n > 0.
absl::Status ValidateGatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                                const int64_t* ids, int64_t n, const void* out);
absl::Status ValidateIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                                  const float* grad, int64_t rows);

// Host ids against [0, rows): INVALID_ARGUMENT naming the first id outside it. With
// `non_decreasing`, also the first id smaller than the one before it (IndexAddRows' order).
absl::Status CheckRowIds(const int64_t* ids, int64_t n, int64_t rows, bool non_decreasing);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_EMBEDDING_ROWS_H_
