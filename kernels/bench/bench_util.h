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

// Median of `runs` timings of fn() with CUDA events on `stream`, after `warmup` calls.
// before() runs ahead of each timed call, outside the events (e.g. to refill an input that the
// call consumes).
template <typename Fn, typename Before>
float MedianMs(cudaStream_t stream, int warmup, int runs, Fn fn, Before before) {
  for (int i = 0; i < warmup; ++i) {
    before();
    fn();
  }
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<float> ms(runs);
  for (int i = 0; i < runs; ++i) {
    before();
    BENCH_CUDA(cudaEventRecord(a, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    BENCH_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[runs / 2];
}

template <typename Fn>
float MedianMs(cudaStream_t stream, int warmup, int runs, Fn fn) {
  return MedianMs(stream, warmup, runs, fn, [] {});
}

// Medians of `fa` and `fb` timed in alternating pairs (a then b, then b then a, and so on), so
// that a drift of the card's clocks over the runs (heat, power) weighs on both alike: timing all
// of one and then all of the other put the drift into the difference.
template <typename Fa, typename Fb>
std::pair<float, float> PairedMedianMs(cudaStream_t stream, int warmup, int runs, Fa fa, Fb fb) {
  for (int i = 0; i < warmup; ++i) {
    fa();
    fb();
  }
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  auto time = [&](auto& fn) {
    float ms = 0;
    BENCH_CUDA(cudaEventRecord(a, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms;
  };
  std::vector<float> ms_a(runs), ms_b(runs);
  for (int i = 0; i < runs; ++i) {
    if (i % 2 == 0) {
      ms_a[i] = time(fa);
      ms_b[i] = time(fb);
    } else {
      ms_b[i] = time(fb);
      ms_a[i] = time(fa);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms_a.begin(), ms_a.end());
  std::sort(ms_b.begin(), ms_b.end());
  return {ms_a[runs / 2], ms_b[runs / 2]};
}

// Medians of each of `fns` timed in rounds, one call of each per round, after `warmup` rounds:
// PairedMedianMs for any number of candidates, the drift weighing on all alike.
inline std::vector<float> RoundsMedianMs(cudaStream_t stream, int warmup, int runs,
                                         const std::vector<std::function<void()>>& fns) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<std::vector<float>> ms(fns.size());
  for (int round = -warmup; round < runs; ++round) {
    for (size_t i = 0; i < fns.size(); ++i) {
      BENCH_CUDA(cudaEventRecord(a, stream));
      fns[i]();
      BENCH_CUDA(cudaEventRecord(b, stream));
      BENCH_CUDA(cudaEventSynchronize(b));
      float t = 0;
      BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
      if (round >= 0) ms[i].push_back(t);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<float> medians;
  for (std::vector<float>& m : ms) {
    std::sort(m.begin(), m.end());
    medians.push_back(m[m.size() / 2]);
  }
  return medians;
}

}  // namespace losshead::bench

#endif  // LOSSHEAD_KERNELS_BENCH_BENCH_UTIL_H_
