// Helpers shared by the benchmarks: exit-on-error checks and the CUDA-event timer.
#ifndef LOSSHEAD_KERNELS_BENCH_BENCH_UTIL_H_
#define LOSSHEAD_KERNELS_BENCH_BENCH_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// A benchmark has nobody to return an error to: report where it failed and stop.
#define BENCH_CUDA(expr)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
#define BENCH_OK(expr)                                                   \
  do {                                                                   \
    absl::Status s_ = (expr);                                            \
    if (!s_.ok()) {                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   std::string(s_.message()).c_str());                   \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

namespace losshead::bench {

template <typename T>
T Unwrap(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(v.status().message()).c_str());
    std::exit(1);
  }
  return std::move(*v);
}

// Times calls on `stream` with a pair of CUDA events (made once, freed with it).
class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream) : stream_(stream) {
    BENCH_CUDA(cudaEventCreate(&begin_));
    BENCH_CUDA(cudaEventCreate(&end_));
  }
  ~EventTimer() {
    cudaEventDestroy(begin_);
    cudaEventDestroy(end_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Milliseconds fn() took on the stream.
  template <typename Fn>
  float Ms(Fn&& fn) {
    BENCH_CUDA(cudaEventRecord(begin_, stream_));
    fn();
    BENCH_CUDA(cudaEventRecord(end_, stream_));
    BENCH_CUDA(cudaEventSynchronize(end_));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, begin_, end_));
    return ms;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t begin_, end_;
};

inline float Median(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Median of `runs` timings of fn() with CUDA events on `stream`, after `warmup` calls.
// before() runs ahead of each timed call, outside the events (e.g. to refill an input that the
// call consumes).
template <typename Fn, typename Before>
float MedianMs(cudaStream_t stream, int warmup, int runs, Fn fn, Before before) {
  for (int i = 0; i < warmup; ++i) {
    before();
    fn();
  }
  EventTimer timer(stream);
  std::vector<float> ms(runs);
  for (int i = 0; i < runs; ++i) {
    before();
    ms[i] = timer.Ms(fn);
  }
  return Median(std::move(ms));
}

template <typename Fn>
float MedianMs(cudaStream_t stream, int warmup, int runs, Fn fn) {
  return MedianMs(stream, warmup, runs, fn, [] {});
}

// Medians of each of `fns` timed in rounds, one call of each per round, in order on even rounds
// and in reverse on odd ones (a b, b a, ... for two), after `warmup` rounds: a drift of the
// card's clocks over the runs (heat, power) weighs on all alike, where timing all of one and
// then all of the next puts the drift into their differences.
inline std::vector<float> RoundsMedianMs(cudaStream_t stream, int warmup, int runs,
                                         const std::vector<std::function<void()>>& fns) {
  EventTimer timer(stream);
  const size_t n = fns.size();
  std::vector<std::vector<float>> ms(n);
  for (int round = -warmup; round < runs; ++round) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = round % 2 == 0 ? k : n - 1 - k;
      const float t = timer.Ms(fns[i]);
      if (round >= 0) ms[i].push_back(t);
    }
  }
  std::vector<float> medians;
  for (std::vector<float>& m : ms) medians.push_back(Median(std::move(m)));
  return medians;
}

// RoundsMedianMs of two.
template <typename Fa, typename Fb>
std::pair<float, float> PairedMedianMs(cudaStream_t stream, int warmup, int runs, Fa fa, Fb fb) {
  const std::vector<float> ms = RoundsMedianMs(stream, warmup, runs, {fa, fb});
  return {ms[0], ms[1]};
}

}  // namespace losshead::bench

#endif  // LOSSHEAD_KERNELS_BENCH_BENCH_UTIL_H_
