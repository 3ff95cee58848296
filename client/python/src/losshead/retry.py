"""Retries with exponential backoff, the same policy as the C++ client (losshead/client/retry.h).

What is retried: UNAVAILABLE (server restarting, draining, unreachable, connection dropped, or a
call the server cancelled while shutting down: see ``LossheadError.from_rpc_error``), and
RESOURCE_EXHAUSTED that the server marked as transient with a retry hint (a micro-batch refused
under backpressure, ``MicrobatchError.retry_after_ms > 0``; the hint is honoured as the least
wait). RESOURCE_EXHAUSTED without a hint (a size limit) is permanent and raised at once.

Why retries never double count:

- Micro-batches are re-sent with the same (client_id, sequence): a repeat of one the server
  already counted is answered from its idempotency cache (``StepResult.replayed``) and adds
  nothing.
- Reads (get_head, list_heads, stats, client_progress, download_weights, pull_gradient without
  reset) change nothing on the server; checkpoint only writes the same state again.
- pull_gradient with ``reset=True`` is NOT re-sent once it may have reached the server: if the
  reset happened and the answer was lost, a second pull would return an empty window and the
  first window's dW would be gone without anyone noticing. Instead the client waits (with the
  same backoff) until the server answers a health probe before the single attempt (a connected
  channel alone does not prove the connection alive), and a failure after
  sending is raised unchanged; ``get_head(...).tokens_since_pull`` tells whether the reset
  took place.
- push_weights replacing W is re-sent whole (the same W again); an added delta (``add=True``)
  is re-sent only with an ``expected_weights_version``, so that a repeat of a delta that landed
  fails FAILED_PRECONDITION instead of adding it twice. A retried create_head / delete_head
  whose first attempt landed raises ALREADY_EXISTS / NOT_FOUND.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import grpc

from losshead.errors import LossheadError


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff between attempts; times in seconds. ``max_attempts=1`` disables retries.

    The wait before attempt k + 1 (k failed so far) is
    ``min(initial_backoff * multiplier ** (k - 1), max_backoff)``, scaled by a uniform factor in
    ``[1 - jitter, 1 + jitter]``, and at least the server's retry hint when there is one.
    """

    max_attempts: int = 5  # attempts in all, the first included
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int, error: Optional[BaseException] = None) -> float:
        """Seconds to wait after the `attempt`-th failure (attempt >= 1), given its error."""
        seconds = self.initial_backoff * max(1.0, self.multiplier) ** max(0, attempt - 1)
        seconds = min(seconds, self.max_backoff)
        jitter = min(max(self.jitter, 0.0), 1.0)
        if jitter > 0:
            # Jitter spreads clients refused together so that they do not come back together.
            seconds *= random.uniform(1 - jitter, 1 + jitter)
        hint = retry_after(error)
        if hint is not None:
            seconds = max(seconds, hint)
        return max(0.0, seconds)

    @property
    def attempts(self) -> int:
        return max(1, int(self.max_attempts))


NO_RETRY = RetryPolicy(max_attempts=1)


def retry_after(error: Optional[BaseException]) -> Optional[float]:
    """The server's retry hint carried by `error`, in seconds, if any."""
    ms = getattr(error, "retry_after_ms", 0) if isinstance(error, LossheadError) else 0
    return ms / 1000.0 if ms else None


def is_retryable(error: BaseException) -> bool:
    """UNAVAILABLE, or RESOURCE_EXHAUSTED with a retry hint (see the module's docstring)."""
    if not isinstance(error, LossheadError):
        return False
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return True
    return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after(error) is not None
