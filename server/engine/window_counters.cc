#include "server/engine/window_counters.h"

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "losshead/kernels/step_bound.h"

namespace losshead::server {

void WindowCounters::Count(int64_t tokens, uint64_t version) {
  tokens_ += tokens;
  tokens_total_ += tokens;
  microbatches_ += 1;
  microbatches_total_ += 1;
  if (microbatches_ == 1) {
    min_version_ = max_version_ = version;
    opened_ = absl::Now();
  } else {
    min_version_ = std::min(min_version_, version);
    max_version_ = std::max(max_version_, version);
  }
}

void WindowCounters::Summarize(v1::GradientSummary* s) const {
  s->set_token_count(tokens_);
  s->set_microbatch_count(microbatches_);
  s->set_min_weights_version(microbatches_ > 0 ? min_version_ : 0);
  s->set_max_weights_version(microbatches_ > 0 ? max_version_ : 0);
}

void WindowCounters::Reset() {
  tokens_ = 0;
  microbatches_ = 0;
  min_version_ = max_version_ = 0;
  opened_ = absl::InfinitePast();
  warned_ = false;
  grad_abs_ = 0;
}

absl::Status WindowCounters::ReserveBound(double grad_weight) {
  const double window = grad_abs_ + grad_weight;
  if (!kernels::WithinRange(window, kernels::DType::kFP32)) {
    return absl::OutOfRangeError(absl::StrCat(
        "the gradient window could overflow: its dW elements are bounded by ", grad_abs_,
        " and this micro-batch would add up to ", grad_weight,
        ", past fp32's 3.4e38; nothing was computed or counted: apply the optimizer or pull with "
        "reset to start a new window"));
  }
  grad_abs_ = window;
  return absl::OkStatus();
}

bool WindowCounters::TakeWarning(uint64_t limit) {
  if (limit == 0 || warned_ || microbatches_ <= limit) return false;
  warned_ = true;
  return true;
}

absl::Duration WindowCounters::age() const {
  return microbatches_ > 0 ? absl::Now() - opened_ : absl::ZeroDuration();
}

void WindowCounters::Export(HeadCheckpointData& data) const {
  data.tokens_since_pull = tokens_;
  data.microbatches_since_pull = microbatches_;
  data.min_version_since_pull = min_version_;
  data.max_version_since_pull = max_version_;
  data.tokens_total = tokens_total_;
  data.microbatches_total = microbatches_total_;
}

void WindowCounters::Import(const HeadCheckpointData& data, double grad_abs) {
  tokens_ = data.tokens_since_pull;
  microbatches_ = data.microbatches_since_pull;
  min_version_ = data.min_version_since_pull;
  max_version_ = data.max_version_since_pull;
  if (microbatches_ > 0) opened_ = absl::Now();
  tokens_total_ = data.tokens_total;
  microbatches_total_ = data.microbatches_total;
  grad_abs_ = grad_abs;
}

}  // namespace losshead::server
