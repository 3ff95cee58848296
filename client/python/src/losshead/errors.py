"""The one exception type of the package."""

from __future__ import annotations

from typing import Dict, Optional

import grpc

_BY_VALUE: Dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode for its integer value (UNKNOWN for values outside the enum)."""
    return _BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


class LossheadError(Exception):
    """A failed call or micro-batch.

    `code` is the grpc.StatusCode the server (or the transport) reported, `message` its text.
    For a failed micro-batch of a Step stream, `client_id` and `sequence` name the micro-batch;
    they are None for whole-call failures. `retry_after_ms` > 0 is the server's hint on a
    transient refusal (a micro-batch refused under backpressure): the same micro-batch may be
    re-sent after that many milliseconds; 0 means retrying will not help.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, client_id: Optional[str] = None,
                 sequence: Optional[int] = None, retry_after_ms: int = 0) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.client_id = client_id
        self.sequence = sequence
        self.retry_after_ms = int(retry_after_ms)

    def __reduce__(self) -> tuple:
        # Pickled whole (data-parallel ranks hand rank 0's error to the others): Exception's own
        # reduction would rebuild it from the formatted text alone.
        return (_rebuild, (self.code, self.message, self.client_id, self.sequence,
                           self.retry_after_ms))

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, *,
                       cancelled_here: bool = False) -> "LossheadError":
        """The error for a failed call. CANCELLED on a call this client did not cancel
        (`cancelled_here` False) becomes UNAVAILABLE: gRPC's server cancels the calls it will
        not run while it shuts down (those that reach it after its shutdown began, and those
        still running at the shutdown deadline), a code that promises the caller cancelled
        (grpc/grpc issue 41785). To the caller that is the server going away, which is what
        UNAVAILABLE says and what the retry policy acts on; the message keeps the original."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else str(error)) or ""
        if code == grpc.StatusCode.CANCELLED and not cancelled_here:
            return cls(grpc.StatusCode.UNAVAILABLE,
                       "the server ended the call without answering (it may be shutting down): "
                       f"CANCELLED: {details}")
        return cls(code or grpc.StatusCode.UNKNOWN, details)


def _rebuild(code: grpc.StatusCode, message: str, client_id: Optional[str],
             sequence: Optional[int], retry_after_ms: int) -> LossheadError:
    return LossheadError(code, message, client_id=client_id, sequence=sequence,
                         retry_after_ms=retry_after_ms)
