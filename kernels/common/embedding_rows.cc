#include "losshead/kernels/embedding_rows.h"

#include "absl/strings/str_cat.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {
namespace {

absl::Status ValidateShape(int64_t rows, int64_t d, int64_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("row count n must be >= 0, got ", n));
  if (d < 1) return absl::InvalidArgumentError(absl::StrCat("row width d must be >= 1, got ", d));
  if (rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("the table must have >= 1 row, got ", rows));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                                const int64_t* ids, int64_t n, const void* out) {
  if (absl::Status s = ValidateShape(rows, d, n); !s.ok()) return s;
  if (dtype != DType::kBF16 && dtype != DType::kFP16 && dtype != DType::kFP32) {
    return absl::InvalidArgumentError("GatherRows takes a BF16, FP16 or FP32 table");
  }
  if (n > 0 && (weights == nullptr || ids == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError("GatherRows with a null pointer");
  }
  return absl::OkStatus();
}

absl::Status ValidateIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                                  const float* grad, int64_t rows) {
  if (absl::Status s = ValidateShape(rows, d, n); !s.ok()) return s;
  if (n > 0 && (values == nullptr || ids == nullptr || grad == nullptr)) {
    return absl::InvalidArgumentError("IndexAddRows with a null pointer");
  }
  return absl::OkStatus();
}

absl::Status CheckRowIds(const int64_t* ids, int64_t n, int64_t rows, bool non_decreasing) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("id ", ids[i], " at position ", i, " is outside [0, ", rows, ")"));
    }
    if (non_decreasing && i > 0 && ids[i] < ids[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("ids must be non-decreasing: id ", ids[i],
                                                     " at position ", i, " follows ", ids[i - 1]));
    }
  }
  return absl::OkStatus();
}

absl::Status Backend::GatherRows(DType, const void*, int64_t, int64_t, const int64_t*, int64_t,
                                 void*, Stream&) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no GatherRows"));
}

absl::Status Backend::IndexAddRows(const float*, const int64_t*, int64_t, int64_t, float*, int64_t,
                                   Stream&) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no IndexAddRows"));
}

}  // namespace losshead::kernels
