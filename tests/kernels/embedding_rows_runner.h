// Backend::GatherRows and Backend::IndexAddRows run through the Backend API (device buffers,
// copies, one stream), for the CPU suite and the CUDA suite alike.
#ifndef LOSSHEAD_TESTS_KERNELS_EMBEDDING_ROWS_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_EMBEDDING_ROWS_RUNNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels::testing {

// The rows of `table` (rows x d elements of `dtype`, raw bytes) for `ids`: n x d raw bytes.
absl::StatusOr<std::string> RunGatherRows(Backend& backend, DType dtype, const std::string& table,
                                          int64_t rows, int64_t d, const std::vector<int64_t>& ids);

// `grad` (rows x d) after IndexAddRows(values (ids.size() x d), ids).
absl::StatusOr<std::vector<float>> RunIndexAddRows(Backend& backend, std::vector<float> grad,
                                                   int64_t rows, int64_t d,
                                                   const std::vector<float>& values,
                                                   const std::vector<int64_t>& ids);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_EMBEDDING_ROWS_RUNNER_H_
