#include "kernels/cpu/embedding_rows.h"

#include <cstring>
#include <vector>

#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels {

void CpuGatherRows(DType dtype, const void* weights, int64_t d, const int64_t* ids, int64_t n,
                   void* out, ThreadPool& pool) {
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dtype);
  const char* src = static_cast<const char*>(weights);
  char* dst = static_cast<char*>(out);
  pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, row_bytes);
    }
  });
}

void CpuIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d, float* grad,
                     ThreadPool& pool) {
  // Runs of equal ids: each is one destination row, so runs can go to different threads without
  // two of them writing one row.
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || ids[i] != ids[i - 1]) starts.push_back(i);
  }
  starts.push_back(n);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  pool.ParallelFor(runs, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t first = starts[r];
      const int64_t last = starts[r + 1];
      std::memcpy(sum.data(), values + first * d, d * sizeof(float));
      for (int64_t i = first + 1; i < last; ++i) {
        const float* row = values + i * d;
        for (int64_t j = 0; j < d; ++j) sum[j] += row[j];
      }
      float* target = grad + ids[first] * d;
      for (int64_t j = 0; j < d; ++j) target[j] += sum[j];
    }
  });
}

}  // namespace losshead::kernels
