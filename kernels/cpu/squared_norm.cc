#include "kernels/cpu/squared_norm.h"

#include <vector>

namespace losshead::kernels {
namespace {

constexpr int64_t kChunk = int64_t{1} << 15;
// Independent accumulators within a chunk: lets the compiler vectorise the loop while the order
// of additions stays fixed by the element index.
constexpr int kLanes = 8;

double ChunkSum(const float* data, int64_t count) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      // A float's square is exact in fp64: only the additions round.
      const double x = data[i + l];
      lanes[l] += x * x;
    }
  }
  for (int l = 0; i < count; ++i, ++l) {
    const double x = data[i];
    lanes[l] += x * x;
  }
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

}  // namespace

double CpuSquaredNorm(const float* data, int64_t count, ThreadPool& pool) {
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks, 0.0);
  pool.ParallelFor(chunks, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * kChunk;
      partial[c] = ChunkSum(data + start, count - start < kChunk ? count - start : kChunk);
    }
  });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace losshead::kernels
