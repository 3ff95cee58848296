// Retries with exponential backoff for the C++ client.
//
// What is retried: UNAVAILABLE (server restarting, draining, unreachable, connection dropped, or a
// call the server cancelled while shutting down: see FromGrpcStatus in status.h), and
// RESOURCE_EXHAUSTED that the server marked as transient with a retry hint (a micro-batch refused
// under backpressure, StepResponse.error.retry_after_ms > 0; the hint is honoured as the least
// wait). RESOURCE_EXHAUSTED without a hint (a size limit) is permanent and returned at once.
//
// Why retries never double count:
// - Micro-batches are re-sent with the same (client_id, sequence): a repeat of one the server
//   already counted is answered from its idempotency cache (StepResult.replayed) and adds nothing.
// - Reads (GetHead, ListHeads, GetStats, DownloadWeights, PullGradient without reset) change
//   nothing on the server.
// - PullGradient with reset = true is NOT re-sent once it may have reached the server: if the
//   reset happened and the answer was lost, a second pull would return an empty window and the
//   first window's dW would be gone without anyone noticing. Instead the client waits (with the
//   same backoff) until the server answers a health probe before the single attempt (a
//   connected channel may still hold a connection the server has dropped), and a failure after
//   sending is returned unchanged; the caller can read GetHead().tokens_since_pull to learn
//   whether the reset took place.
// - PushWeights REPLACE is re-sent whole (the same W again); PUSH_MODE_ADD is re-sent only with
//   an expected_weights_version, so that a repeat of a delta that landed fails FAILED_PRECONDITION
//   instead of adding it twice. A retried CreateHead / DeleteHead whose first attempt landed
//   answers ALREADY_EXISTS / NOT_FOUND.
#ifndef LOSSHEAD_CLIENT_RETRY_H_
#define LOSSHEAD_CLIENT_RETRY_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace losshead::client {

struct RetryPolicy {
  int max_attempts = 5;  // attempts in all, the first included; 1 disables retries
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;  // each wait is scaled by a uniform factor in [1 - jitter, 1 + jitter]
};

// The status payload under which the client keeps a server's retry hint (milliseconds, decimal).
inline constexpr absl::string_view kRetryAfterPayload = "type.losshead.dev/retry_after_ms";

// The server's retry hint carried by `status`, if any.
std::optional<absl::Duration> RetryAfter(const absl::Status& status);

// UNAVAILABLE, or RESOURCE_EXHAUSTED with a retry hint (see above).
bool IsRetryable(const absl::Status& status);

// The wait before attempt `attempt` + 1 (attempt >= 1 failed ones so far): exponential, capped,
// jittered, and at least the status's retry hint.
absl::Duration BackoffDelay(const RetryPolicy& policy, int attempt, const absl::Status& status);

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_RETRY_H_
