// The gradient window of one head as counted on the host: the micro-batches and tokens counted in
// dW since the last cut that reset it (a pull with reset, a discard, an optimizer apply), the
// weights versions they ran against, when the window opened, the totals since the head was made,
// and the bound on every element of the window's dW (kernels/step_bound.h) that keeps the window
// from ever reaching Inf.
//
// Plain data with the arithmetic of counting; not thread-safe. The head guards it with its state
// mutex, and a micro-batch counts itself while its run is in flight, so that a cut (which holds
// every compute lock and waits for the runs in flight) sees each micro-batch wholly in the window
// or wholly in the next.
#ifndef LOSSHEAD_SERVER_ENGINE_WINDOW_COUNTERS_H_
#define LOSSHEAD_SERVER_ENGINE_WINDOW_COUNTERS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/head_checkpoint.h"

namespace losshead::server {

class WindowCounters {
 public:
  // A micro-batch of `tokens` counted tokens, run against weights `version`; the first one opens
  // the window.
  void Count(int64_t tokens, uint64_t version);
  // What the window covers (its counts and versions) into `s`.
  void Summarize(v1::GradientSummary* s) const;
  // The window cut: counts, versions, its opening, its warning and its bound start afresh (the
  // totals go on).
  void Reset();

  // Adds `grad_weight` (a micro-batch's bound on its part of every dW element) to the window's
  // bound: OUT_OF_RANGE, and nothing changed, where the sum could pass fp32's range.
  absl::Status ReserveBound(double grad_weight);

  // Once per window: true the first time it holds more than `limit` micro-batches (`limit` 0:
  // never).
  bool TakeWarning(uint64_t limit);

  uint64_t microbatches() const { return microbatches_; }
  uint64_t tokens() const { return tokens_; }
  uint64_t microbatches_total() const { return microbatches_total_; }
  uint64_t tokens_total() const { return tokens_total_; }
  // Since the window's first micro-batch was counted (or since the restore that brought it back);
  // zero for an empty window.
  absl::Duration age() const;

  // The counters a checkpoint keeps, out and back in. The window's opening is not in the file: a
  // restored window counts its age from the restore. `grad_abs` bounds the restored dW.
  void Export(HeadCheckpointData& data) const;
  void Import(const HeadCheckpointData& data, double grad_abs);

 private:
  uint64_t tokens_ = 0;
  uint64_t microbatches_ = 0;
  uint64_t min_version_ = 0;
  uint64_t max_version_ = 0;
  // When the first micro-batch was counted (InfinitePast while empty), and whether the warning was
  // given.
  absl::Time opened_ = absl::InfinitePast();
  bool warned_ = false;
  uint64_t tokens_total_ = 0;
  uint64_t microbatches_total_ = 0;
  // The sum of the bounds of the micro-batches counted (reserved before each run).
  double grad_abs_ = 0;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_WINDOW_COUNTERS_H_
