// What the definitions of Metrics (metrics.cc, metrics_traffic.cc, metrics_state.cc) share: the
// histograms' buckets and the kinds of memory a head holds. Not for use outside observability/.
#ifndef LOSSHEAD_SERVER_OBSERVABILITY_METRICS_INTERNAL_H_
#define LOSSHEAD_SERVER_OBSERVABILITY_METRICS_INTERNAL_H_

#include <array>
#include <cstdint>
#include <utility>

#include "absl/time/time.h"
#include "prometheus/histogram.h"
#include "server/observability/metrics.h"

namespace losshead::server::metrics_internal {

// The kinds of memory heads hold, by label value: the series of head_memory and device_memory.
inline std::array<std::pair<const char*, uint64_t>, 5> HeldKinds(const DeviceMemory& m) {
  return {{{"weights", m.weights},
           {"gradient", m.gradient},
           {"workspace", m.workspace},
           {"master_weights", m.master_weights},
           {"optimizer_state", m.optimizer_state}}};
}

// Seconds, from 0.1 ms (a tiny micro-batch's queue wait) to 60 s (a 2 GiB pull on a slow link).
inline const prometheus::Histogram::BucketBoundaries& Buckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
  return *buckets;
}

// Seconds, from 10 ms (a small head on a local disk) to 10 minutes (tens of GiB of W, dW and
// optimizer state fsynced to network storage).
inline const prometheus::Histogram::BucketBoundaries& CheckpointBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  return *buckets;
}

inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace losshead::server::metrics_internal

#endif  // LOSSHEAD_SERVER_OBSERVABILITY_METRICS_INTERNAL_H_
