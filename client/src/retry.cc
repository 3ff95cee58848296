#include "losshead/client/retry.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "absl/strings/numbers.h"

namespace losshead::client {

std::optional<absl::Duration> RetryAfter(const absl::Status& status) {
  auto payload = status.GetPayload(kRetryAfterPayload);
  uint32_t ms = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &ms) || ms == 0) {
    return std::nullopt;
  }
  return absl::Milliseconds(ms);
}

bool IsRetryable(const absl::Status& status) {
  if (absl::IsUnavailable(status)) return true;
  return absl::IsResourceExhausted(status) && RetryAfter(status).has_value();
}

absl::Duration BackoffDelay(const RetryPolicy& policy, int attempt, const absl::Status& status) {
  double seconds = absl::ToDoubleSeconds(policy.initial_backoff) *
                   std::pow(std::max(1.0, policy.multiplier), std::max(0, attempt - 1));
  seconds = std::min(seconds, absl::ToDoubleSeconds(policy.max_backoff));
  const double jitter = std::clamp(policy.jitter, 0.0, 1.0);
  if (jitter > 0) {
    // Jitter spreads clients refused together so that they do not come back together.
    thread_local std::mt19937_64 rng(std::random_device{}());
    seconds *= std::uniform_real_distribution<double>(1 - jitter, 1 + jitter)(rng);
  }
  absl::Duration delay = absl::Seconds(seconds);
  if (auto hint = RetryAfter(status); hint.has_value()) delay = std::max(delay, *hint);
  return delay;
}

}  // namespace losshead::client
