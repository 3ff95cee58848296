// What a head tied to its model's input embedding does besides the loss (StepKind in the proto):
// the host-side preparation of an EMBEDDING_GRAD micro-batch and of an EmbeddingRows request, each
// validated whole before anything reaches a device. Head::EmbeddingRows and the embedding branch
// of Head::Step (embedding_rows.cc) run them on the devices that hold each id's row.
#ifndef LOSSHEAD_SERVER_ENGINE_EMBEDDING_ROWS_H_
#define LOSSHEAD_SERVER_ENGINE_EMBEDDING_ROWS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/step_bound.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/micro_batch.h"

namespace losshead::server {

// `ids` (id_dtype INT32 | INT64, raw little-endian) as int64, each in [0, vocab_size):
// INVALID_ARGUMENT for another dtype, a byte length that is not a whole number of ids,
// `expected` ids (when >= 0) that are not there, or an id outside the range (the first named).
absl::StatusOr<std::vector<int64_t>> ParseRowIds(v1::DType id_dtype, absl::string_view ids,
                                                 int64_t vocab_size, int64_t expected = -1);

// An EMBEDDING_GRAD header on its own: num_tokens >= 1, a float hidden_dtype, an integer
// target_dtype, and none of the loss's options set (INVALID_ARGUMENT naming the first).
absl::Status CheckEmbeddingGradHeader(const v1::StepHeader& header);

// An EMBEDDING_GRAD micro-batch ready for IndexAddRows: its rows in fp32 ordered by id (a stable
// sort, so that an id's rows keep the order they were sent in), with what the window's guard
// needs.
struct PreparedEmbeddingGrad {
  std::vector<int64_t> ids;   // non-decreasing
  std::vector<float> values;  // ids.size() x D, row i for ids[i]
  double max_abs = 0;         // the largest |dE| (finite)
  int64_t max_repeats = 0;    // the most rows one id has
  // What any element of dW may gain: the sum of one id's rows is at most this.
  double grad_bound() const { return kernels::BoundEmbeddingGrad(max_abs, max_repeats); }
};

// The whole micro-batch: the header's checks, then sizes (INVALID_ARGUMENT naming the expected
// bytes), ids in range and dE finite (INVALID_ARGUMENT).
absl::StatusOr<PreparedEmbeddingGrad> PrepareEmbeddingGrad(const MicroBatch& microbatch,
                                                           int64_t vocab_size, int64_t hidden_size);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_EMBEDDING_ROWS_H_
