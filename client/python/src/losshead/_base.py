"""What every part of the client shares: its identity, the retry loop and unary calls."""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar

import grpc

from losshead._health import NOT_SERVING, HealthProbe
from losshead._lanes import LaneThreads
from losshead.errors import LossheadError
from losshead.retry import RetryPolicy, is_retryable

if TYPE_CHECKING:
    import torch

    from losshead._batch_check import HeadFacts
    from losshead._native import NativeClient
    from losshead._proto.losshead.v1 import losshead_pb2_grpc as pb_grpc

_T = TypeVar("_T")


class ClientBase:
    """State and plumbing of `losshead.Client` (see there); the parts of the client derive
    from it."""

    target: str
    client_id: str
    timeout: Optional[float]
    piece_bytes: int
    retry: RetryPolicy
    _stub: "pb_grpc.LossHeadStub"
    _step_stubs: List["pb_grpc.LossHeadStub"]
    _health: HealthProbe
    _metadata: Optional[Tuple[Tuple[str, str], ...]]
    # The native data path, one C++ client per connection; empty: everything speaks grpcio.
    _natives: List["NativeClient"]
    _closed: bool
    # Per head, what a cut batch is checked against before it is sent (losshead._batch_check).
    _head_facts: Dict[str, "HeadFacts"]
    # Per head, its hidden size and weight dtype as last read: what the native path sizes
    # embedding rows by.
    _embedding_shapes: Dict[str, Tuple[int, "torch.dtype"]]

    def __init__(self) -> None:
        self._retries = 0
        self._retries_lock = threading.Lock()
        self._seq_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._natives = []
        self._head_facts = {}
        self._embedding_shapes = {}
        self._lanes = LaneThreads("losshead-step")

    def get_head(self, name: str) -> Any:  # defined by Client; the transfers read shapes
        raise NotImplementedError

    def _open_step_connections(self, streams: int) -> None:  # defined by Client
        raise NotImplementedError

    def _follow_home(self, address: Optional[str]) -> bool:  # defined by Client
        raise NotImplementedError

    def next_sequence(self) -> int:
        """A fresh sequence number for this client's idempotency keys."""
        with self._seq_lock:
            return next(self._seq)

    @property
    def retries(self) -> int:
        """Attempts that were retries (all methods, either path), since the client was made."""
        return self._retries + sum(n.retries for n in self._natives)

    @property
    def native(self) -> bool:
        """Whether steps and transfers go through the native library (`losshead._native`)."""
        return bool(self._natives)

    def _check_open(self) -> None:
        """A closed client refuses every call alike, whichever path the call would take."""
        if self._closed:
            raise LossheadError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")

    def _count_retry(self) -> None:
        with self._retries_lock:
            self._retries += 1

    def _with_retry(self, attempt: Callable[[], _T]) -> _T:
        """Runs `attempt` until it succeeds, fails permanently or the policy is spent."""
        self._check_open()
        policy = self.retry
        for i in itertools.count(1):
            try:
                return attempt()
            except LossheadError as e:
                if i >= policy.attempts or not is_retryable(e):
                    raise
                self._count_retry()
                time.sleep(policy.delay(i, e))
        raise AssertionError("unreachable")

    def _wait_for_connection(self) -> None:
        """Waits, with the retry policy's backoff, until the server answers on this channel;
        gives up quietly when the policy is spent (the single attempt that follows reports the
        error). Each wait is a health probe that waits for a connection (wait_for_ready) for
        that long: unlike the channel's state, an answer proves the connection is alive."""
        self._check_open()
        policy = self.retry
        for i in range(1, policy.attempts):
            wait = policy.delay(i)
            start = time.monotonic()
            try:
                status = self._health.check(timeout=wait, metadata=self._metadata,
                                            wait_for_ready=True)
                if status != NOT_SERVING:  # NOT_SERVING: draining, its calls are refused
                    return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.UNAVAILABLE):
                    return  # the server answered (e.g. no health service): it is there
            self._count_retry()
            time.sleep(max(0.0, wait - (time.monotonic() - start)))

    def _unary_once(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None

    def _unary(self, method: Callable[..., Any], request: Any) -> Any:
        return self._with_retry(lambda: self._unary_once(method, request))
