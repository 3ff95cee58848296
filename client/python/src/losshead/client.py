"""Client for the losshead v1 gRPC service (proto/losshead/v1/losshead.proto).

Tensors are torch tensors on the caller's side and raw little-endian bytes on the wire. Every
failure raises `LossheadError` with the grpc.StatusCode of the call or of the failed micro-batch.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import (Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence,
                    Tuple, TypeVar, Union)

import grpc
import torch

from losshead import _wire
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._proto.losshead.v1 import losshead_pb2_grpc as pb_grpc
from losshead._wire import DTypeLike
from losshead.errors import LossheadError, status_code
from losshead.retry import RetryPolicy, is_retryable

ReductionLike = Union[str, int, None]
# PEM data for the TLS options: a file path, or the PEM bytes themselves.
PemLike = Union[str, bytes, "os.PathLike[str]", None]
_T = TypeVar("_T")

_REDUCTIONS = {
    None: pb.REDUCTION_UNSPECIFIED, "": pb.REDUCTION_UNSPECIFIED,
    "mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE,
}
_MiB = 1 << 20


def to_reduction(reduction: ReductionLike) -> int:
    """The proto Reduction for "mean" | "sum" | "none" | None (inherit) or an enum value."""
    if isinstance(reduction, int):
        return reduction
    try:
        return _REDUCTIONS[reduction.lower() if isinstance(reduction, str) else reduction]
    except KeyError:
        raise ValueError(f"losshead: unknown reduction {reduction!r}") from None


@dataclass
class LossOptions:
    """Loss options; None inherits (request -> head default -> built-in default).

    Built-in defaults: ignore_index -100, reduction mean, no label smoothing, z-loss or soft-cap.
    """

    ignore_index: Optional[int] = None
    reduction: ReductionLike = None
    label_smoothing: Optional[float] = None
    z_loss: Optional[float] = None
    logit_softcap: Optional[float] = None

    def to_proto(self) -> pb.LossOptions:
        msg = pb.LossOptions(reduction=to_reduction(self.reduction))
        if self.ignore_index is not None:
            msg.ignore_index = int(self.ignore_index)
        if self.label_smoothing is not None:
            msg.label_smoothing = float(self.label_smoothing)
        if self.z_loss is not None:
            msg.z_loss = float(self.z_loss)
        if self.logit_softcap is not None:
            msg.logit_softcap = float(self.logit_softcap)
        return msg


@dataclass
class StepResult:
    """The outcome of one micro-batch (or, from `step_chunked`, of all its chunks combined).

    `loss` is the reduced loss the server computed (for a combined result: `loss_sum`, or the
    mean over `token_count` for reduction "mean"), `grad_hidden` is dH (N x D, CPU, the dtype
    the server sent) unless skipped, `per_token_loss` the fp32 losses (N) when asked for.
    """

    loss: float
    loss_sum: float
    token_count: int
    weights_version: int
    replayed: bool
    client_id: str
    sequence: int
    grad_hidden: Optional[torch.Tensor] = None
    per_token_loss: Optional[torch.Tensor] = None
    forward_only: bool = False


@dataclass
class GradientSummary:
    """What a pulled dW covers (see GradientSummary in the proto)."""

    vocab_size: int
    hidden_size: int
    token_count: int
    microbatch_count: int
    min_weights_version: int
    max_weights_version: int
    was_reset: bool


@dataclass
class Gradient:
    grad: torch.Tensor  # V x D on the CPU, fp32 unless another dtype was asked for
    summary: GradientSummary


@dataclass
class Weights:
    weights: torch.Tensor  # V x D on the CPU
    version: int


@dataclass
class ClientProgress:
    """Highest sequence of a client id applied to dW on the server ("acknowledged") and the
    highest one in the head's last checkpoint ("persisted"); None when there is none."""

    client_id: str
    acknowledged_sequence: Optional[int]
    persisted_sequence: Optional[int]

    @classmethod
    def from_proto(cls, msg: pb.ClientProgress) -> "ClientProgress":
        return cls(client_id=msg.client_id,
                   acknowledged_sequence=(msg.acknowledged_sequence
                                          if msg.HasField("acknowledged_sequence") else None),
                   persisted_sequence=(msg.persisted_sequence
                                       if msg.HasField("persisted_sequence") else None))


@dataclass
class HeadCheckpoint:
    """One head's checkpoint as written: what it holds and, per client id, what is persisted."""

    head: str
    weights_version: int
    microbatches_since_pull: int
    bytes: int
    write_seconds: float
    clients: List[ClientProgress] = field(default_factory=list)


@dataclass
class _Microbatch:
    """One encoded micro-batch, ready to be framed into StepRequest messages."""

    header: pb.StepHeader
    hidden: bytes
    targets: bytes
    hidden_size: int

    @property
    def key(self) -> Tuple[str, int]:
        return self.header.client_id, self.header.sequence

    def messages(self, piece_bytes: int) -> Iterator[pb.StepRequest]:
        """Header + pieces + last, each message carrying at most `piece_bytes` of tensor data."""
        hidden, targets = memoryview(self.hidden), memoryview(self.targets)
        h_off = t_off = 0
        first = True
        while True:
            budget = piece_bytes
            h_piece = hidden[h_off:h_off + budget]
            h_off += len(h_piece)
            budget -= len(h_piece)
            t_piece = targets[t_off:t_off + budget] if budget > 0 else targets[t_off:t_off]
            t_off += len(t_piece)
            last = h_off == len(hidden) and t_off == len(targets)
            msg = pb.StepRequest(hidden=bytes(h_piece), targets=bytes(t_piece), last=last)
            if first:
                msg.header.CopyFrom(self.header)
                first = False
            yield msg
            if last:
                return


class StepStream:
    """One Step call: micro-batches go out in submission order and come back in that order.

    `submit` only queues; gRPC's own thread frames and sends, so the next micro-batch travels
    while the caller reads the answer of the previous one with `receive`. A failed micro-batch
    raises LossheadError from `receive` and the stream goes on; a failed call raises
    LossheadError from `receive` for every micro-batch still unanswered.
    """

    def __init__(self, client: "Client", connection: int = 0) -> None:
        self._client = client
        self._queue: "queue.Queue[Optional[_Microbatch]]" = queue.Queue()
        self._pending: Deque[_Microbatch] = collections.deque()
        stub = client._step_stubs[connection % len(client._step_stubs)]
        self._call = stub.Step(self._requests(), metadata=client._metadata)
        self._responses = iter(self._call)
        self._broken: Optional[LossheadError] = None
        self._closed = False

    def _requests(self) -> Iterator[pb.StepRequest]:
        while True:
            mb = self._queue.get()
            if mb is None:
                return
            yield from mb.messages(self._client.piece_bytes)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, mb: _Microbatch) -> None:
        if self._closed or self._broken is not None:
            raise LossheadError(grpc.StatusCode.FAILED_PRECONDITION, "step stream is closed")
        self._pending.append(mb)
        self._queue.put(mb)

    def _next_response(self) -> pb.StepResponse:
        if self._broken is not None:
            raise self._broken
        try:
            return next(self._responses)
        except StopIteration:
            self._broken = LossheadError(
                grpc.StatusCode.INTERNAL,
                f"Step stream ended with {len(self._pending)} micro-batch(es) unanswered")
        except grpc.RpcError as e:
            self._broken = LossheadError.from_rpc_error(e)
        raise self._broken

    def receive(self) -> StepResult:
        """The answer to the oldest unanswered micro-batch."""
        if not self._pending:
            raise LossheadError(grpc.StatusCode.FAILED_PRECONDITION, "nothing submitted")
        mb = self._pending[0]
        first = self._next_response()
        client_id, sequence = mb.key
        if (first.client_id, first.sequence) != (client_id, sequence):
            self._broken = LossheadError(
                grpc.StatusCode.INTERNAL,
                f"answer for ({first.client_id}, {first.sequence}) while expecting "
                f"({client_id}, {sequence})")
            raise self._broken
        self._pending.popleft()
        outcome = first.WhichOneof("outcome")
        if outcome == "error":
            if not first.last:  # an error is the micro-batch's only message
                self._drain_until_last()
            raise LossheadError(status_code(first.error.code), first.error.message,
                                client_id=client_id, sequence=sequence,
                                retry_after_ms=first.error.retry_after_ms)
        if outcome != "result":
            self._broken = LossheadError(grpc.StatusCode.INTERNAL,
                                         "first answer of a micro-batch has no result")
            raise self._broken
        res = first.result
        dh = bytearray(res.grad_hidden_bytes)
        ptl = bytearray(res.per_token_loss_bytes)
        dh_off = ptl_off = 0
        msg = first
        while True:
            if msg.grad_hidden:
                dh[dh_off:dh_off + len(msg.grad_hidden)] = msg.grad_hidden
                dh_off += len(msg.grad_hidden)
            if msg.per_token_loss:
                ptl[ptl_off:ptl_off + len(msg.per_token_loss)] = msg.per_token_loss
                ptl_off += len(msg.per_token_loss)
            if msg.last:
                break
            msg = self._next_response()
        if dh_off != len(dh) or ptl_off != len(ptl):
            raise LossheadError(grpc.StatusCode.INTERNAL,
                                f"micro-batch {sequence}: got {dh_off}/{len(dh)} dH bytes and "
                                f"{ptl_off}/{len(ptl)} per-token loss bytes",
                                client_id=client_id, sequence=sequence)
        if mb.header.options.forward_only and not res.forward_only:
            # A server that predates forward_only ignores it: this micro-batch was added to dW.
            # Saying so is all that is left to do; pretending it was an evaluation is not.
            raise LossheadError(grpc.StatusCode.UNIMPLEMENTED,
                                f"micro-batch {sequence}: the server does not support "
                                "forward_only and counted it in dW (upgrade the server)",
                                client_id=client_id, sequence=sequence)
        n = mb.header.num_tokens
        grad_hidden = per_token_loss = None
        if res.grad_hidden_bytes:
            grad_hidden = _wire.decode(dh, res.grad_hidden_dtype, (n, mb.hidden_size))
        if res.per_token_loss_bytes:
            per_token_loss = _wire.decode(ptl, pb.DTYPE_FP32, (n,))
        return StepResult(loss=res.loss, loss_sum=res.loss_sum, token_count=res.token_count,
                          weights_version=res.weights_version, replayed=res.replayed,
                          client_id=client_id, sequence=sequence, grad_hidden=grad_hidden,
                          per_token_loss=per_token_loss, forward_only=res.forward_only)

    def _drain_until_last(self) -> None:
        while not self._next_response().last:
            pass

    def unanswered(self) -> List[_Microbatch]:
        return list(self._pending)

    def close(self) -> None:
        """Half-closes the stream; cancels it if micro-batches are still unanswered."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._pending or self._broken is not None:
            self._call.cancel()
            return
        try:
            for _ in self._responses:  # collect the final status
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_Outcome = Union[StepResult, LossheadError]


class _StepPipeline:
    """Micro-batches over one Step stream at a time, each re-sent under its idempotency key.

    The same scheduling as the C++ client's StepMany: up to `depth` micro-batches are on the
    stream; one answered with a retryable error (RESOURCE_EXHAUSTED with a retry hint, or
    UNAVAILABLE) is re-sent with the same (client_id, sequence) once its backoff has passed; when
    the call itself fails (server restart, drain, dropped connection) every micro-batch still
    unanswered on it is re-sent on a new stream. A resend of one that had landed is answered
    from the server's idempotency cache (`replayed`), so nothing is counted twice. Outcomes are
    yielded in input order; at most `depth` micro-batches are unsettled or held for ordering.
    """

    def __init__(self, client: "Client", connection: int = 0,
                 depth: Optional[int] = None) -> None:
        self._client = client
        self._connection = connection
        self._depth = float("inf") if depth is None else max(1, int(depth))

    def run(self, source: Iterator[Tuple[int, _Microbatch]]
            ) -> Iterator[Tuple[int, _Outcome]]:
        """(index, micro-batch) pairs in increasing index order -> (index, outcome) pairs."""
        client, policy, depth = self._client, self._client.retry, self._depth
        unsettled: Dict[int, _Microbatch] = {}
        attempts: Dict[int, int] = {}
        order: Deque[int] = collections.deque()  # indices taken from `source`, not yet yielded
        held: Dict[int, _Outcome] = {}
        todo: List[Tuple[int, float]] = []  # (index, earliest resend time), in scheduling order
        sent: Deque[int] = collections.deque()  # on `stream`, not yet answered
        stream: Optional[StepStream] = None
        exhausted = False

        def settle(i: int, outcome: _Outcome) -> None:
            if (isinstance(outcome, LossheadError) and is_retryable(outcome)
                    and attempts[i] < policy.attempts):
                client._count_retry()
                todo.append((i, time.monotonic() + policy.delay(attempts[i], outcome)))
                return
            del unsettled[i], attempts[i]
            held[i] = outcome

        def ready() -> Iterator[Tuple[int, _Outcome]]:
            while order and order[0] in held:
                i = order.popleft()
                yield i, held.pop(i)

        try:
            while True:
                # Fill the stream: resends whose backoff has passed first, then new ones.
                while len(sent) < depth:
                    now = time.monotonic()
                    due = next((k for k, (_, t) in enumerate(todo) if t <= now), None)
                    if due is not None:
                        i = todo.pop(due)[0]
                    elif not exhausted and len(unsettled) + len(held) < depth:
                        nxt = next(source, None)
                        if nxt is None:
                            exhausted = True
                            continue
                        i, mb = nxt
                        unsettled[i], attempts[i] = mb, 0
                        order.append(i)
                    else:
                        break
                    if stream is None:
                        stream = StepStream(client, connection=self._connection)
                    attempts[i] += 1
                    stream.submit(unsettled[i])
                    sent.append(i)
                if not sent:
                    if not todo:
                        if exhausted:
                            return
                        continue
                    # Everything left is backing off: sleep until the earliest may go.
                    time.sleep(max(0.0, min(t for _, t in todo) - time.monotonic()))
                    continue
                i = sent.popleft()
                try:
                    outcome: _Outcome = stream.receive()  # type: ignore[union-attr]
                except LossheadError as e:
                    outcome = e
                settle(i, outcome)
                if isinstance(outcome, LossheadError) and outcome.sequence is None:
                    # The call itself ended: it owes every other micro-batch on it the same
                    # status. Start over on a new stream; re-sent keys that did land replay.
                    while sent:
                        settle(sent.popleft(), LossheadError(outcome.code, outcome.message))
                    stream.close()  # type: ignore[union-attr]
                    stream = None
                yield from ready()
        finally:
            if stream is not None:
                stream.close()


def _encode_health_request(service: str) -> bytes:
    # grpc.health.v1.HealthCheckRequest{string service = 1}, encoded by hand: the Debian and
    # pip worlds disagree on where the health stubs live, and two copies of the same proto
    # registered in one process is an error.
    raw = service.encode()
    if not raw:
        return b""
    out = bytearray(b"\x0a")
    n = len(raw)
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            break
    return bytes(out + raw)


def _read_varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _decode_health_response(data: bytes) -> int:
    # grpc.health.v1.HealthCheckResponse{ServingStatus status = 1}
    pos, status = 0, 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        wire = tag & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if tag >> 3 == 1:
                status = value
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise LossheadError(grpc.StatusCode.INTERNAL, "malformed HealthCheckResponse")
    return status


_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _default_client_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _read_pem(value: PemLike, what: str) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise LossheadError(grpc.StatusCode.NOT_FOUND,
                            f"cannot read {what} '{os.fspath(value)}': {e.strerror}") from None


def _channel_credentials(tls: bool, root_ca: PemLike, cert: PemLike, key: PemLike
                         ) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials when TLS is asked for (`tls` or any PEM given), else None (plaintext)."""
    if not (tls or root_ca is not None or cert is not None or key is not None):
        return None
    if (cert is None) != (key is None):
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                            "a TLS client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(root_ca, "TLS root CA"),  # None: the system's roots
        private_key=_read_pem(key, "TLS client key"),
        certificate_chain=_read_pem(cert, "TLS client certificate"))


class Client:
    """A connection to one losshead server.

    `client_id` (default: host, pid and a random suffix) and a per-client sequence counter form
    the idempotency key of each micro-batch; a retry resends the same key, so the server
    replays it instead of adding it to dW again. `piece_bytes` bounds the tensor bytes per
    message (below the server's 4 MiB default limit). `timeout` applies to each attempt of a
    unary call or weight/gradient transfer; Step streams have none. `connections` > 1 opens
    that many TCP connections for Step streams (gRPC otherwise multiplexes every stream over
    one), which carries more bytes when chunks are spread over several streams.

    `retry` (a `RetryPolicy`; default 5 attempts, 50 ms doubling to 2 s, +-20 % jitter) governs
    every method; see `losshead.retry` for what is retried and why nothing is counted twice.
    `retries` counts the attempts that were retries since the client was made.

    Security (plaintext by default): `token` is sent on every call as
    `authorization: Bearer <token>`. TLS is on when `tls` or any of `tls_root_ca` (CA that
    signed the server's certificate; default the system's roots), `tls_cert` / `tls_key`
    (client certificate and key, for mTLS) is given, each a file path or the PEM bytes;
    `tls_server_name` is the name to verify in the server's certificate instead of the
    target's host. With `channel` the TLS options are ignored (the channel has its own).
    `channel_options` are extra gRPC channel arguments.
    """

    def __init__(self, target: str, *, client_id: Optional[str] = None,
                 channel: Optional[grpc.Channel] = None, timeout: Optional[float] = 300.0,
                 piece_bytes: int = 4 * _MiB - 64 * 1024, retry: Optional[RetryPolicy] = None,
                 metadata: Sequence[Tuple[str, str]] = (), connections: int = 1,
                 token: Optional[str] = None, tls: bool = False, tls_root_ca: PemLike = None,
                 tls_cert: PemLike = None, tls_key: PemLike = None,
                 tls_server_name: Optional[str] = None,
                 channel_options: Sequence[Tuple[str, Any]] = ()) -> None:
        self.target = target
        self.client_id = client_id or _default_client_id()
        self.timeout = timeout
        self.piece_bytes = int(piece_bytes)
        self.retry = retry if retry is not None else RetryPolicy()
        self._retries = 0
        self._retries_lock = threading.Lock()
        self._base_metadata = tuple(metadata)
        self.set_token(token)
        options = [("grpc.max_receive_message_length", 64 * _MiB),
                   ("grpc.max_send_message_length", 64 * _MiB), *channel_options]
        # A channel whose server went away fails every call fast until it reconnects, and by
        # default gRPC re-resolves the target at most every 30 s and reconnects after 1 s, then
        # x1.6 per failure (a restarted server was first reached ~5 s after it came back): the
        # retries would be spent before it is tried. Reconnect on the policy's schedule.
        defaults = {"grpc.initial_reconnect_backoff_ms": self.retry.initial_backoff,
                    "grpc.max_reconnect_backoff_ms": self.retry.max_backoff,
                    "grpc.dns_min_time_between_resolutions_ms": self.retry.initial_backoff}
        given = {key for key, _ in channel_options}
        options += [(key, max(1, int(seconds * 1000))) for key, seconds in defaults.items()
                    if key not in given]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        credentials = None if channel is not None else _channel_credentials(
            tls, tls_root_ca, tls_cert, tls_key)

        def make_channel(extra: Sequence[Tuple[str, Any]] = ()) -> grpc.Channel:
            if credentials is None:
                return grpc.insecure_channel(target, options=options + list(extra))
            return grpc.secure_channel(target, credentials, options=options + list(extra))

        self._channel = channel or make_channel()
        self._stub = pb_grpc.LossHeadStub(self._channel)
        # A local subchannel pool keeps a channel from sharing its connection with the others.
        self._extra_channels = [] if channel is not None else [
            make_channel([("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, connections) - 1)]
        self._step_stubs = [self._stub] + [pb_grpc.LossHeadStub(c) for c in self._extra_channels]
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)
        self._seq_lock = threading.Lock()
        self._seq = itertools.count(1)

    # -- plumbing ---------------------------------------------------------------------------
    def set_token(self, token: Optional[str]) -> None:
        """Sends `token` (None or "": none) on calls that start from now on; streams already open
        keep theirs. After the server re-read its token file (SIGHUP), a trainer switches to its
        new token without reconnecting."""
        md = list(self._base_metadata)
        if token:
            # Per call rather than as call credentials: gRPC sends call credentials only over
            # TLS, and a token on a plaintext loopback or proxied connection is supported.
            md.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(md) or None

    def close(self) -> None:
        for c in self._extra_channels:
            c.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_sequence(self) -> int:
        """A fresh sequence number for this client's idempotency keys."""
        with self._seq_lock:
            return next(self._seq)

    @property
    def retries(self) -> int:
        """Attempts that were retries (all methods), since the client was made."""
        return self._retries

    def _count_retry(self) -> None:
        with self._retries_lock:
            self._retries += 1

    def _with_retry(self, attempt: Callable[[], _T]) -> _T:
        """Runs `attempt` until it succeeds, fails permanently or the policy is spent."""
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
        policy = self.retry
        for i in range(1, policy.attempts):
            wait = policy.delay(i)
            start = time.monotonic()
            try:
                status = self._health("", timeout=wait, metadata=self._metadata,
                                      wait_for_ready=True)
                if status != 2:  # NOT_SERVING: draining, its calls are refused
                    return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.UNAVAILABLE):
                    return  # the server answered (e.g. no health service): it is there
            self._count_retry()
            time.sleep(max(0.0, wait - (time.monotonic() - start)))

    def _unary_once(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None

    def _unary(self, method, request):  # type: ignore[no-untyped-def]
        return self._with_retry(lambda: self._unary_once(method, request))

    # -- health and stats -------------------------------------------------------------------
    def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        try:
            status = self._health(service, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None
        return _HEALTH_STATUS.get(status, "UNKNOWN")

    def wait_until_serving(self, timeout: float = 30.0) -> None:
        """Polls health until SERVING; raises LossheadError(DEADLINE_EXCEEDED) after `timeout`."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = self.health(timeout=1.0)
                if last == "SERVING":
                    return
            except LossheadError as e:
                last = str(e)
            time.sleep(0.05)
        raise LossheadError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{self.target} not serving after {timeout}s ({last})")

    def stats(self) -> pb.Stats:
        return self._unary(self._stub.GetStats, pb.GetStatsRequest())

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self, head: str = "") -> List[HeadCheckpoint]:
        """Writes the checkpoint of `head` (every head when empty) now; safe to repeat.

        FAILED_PRECONDITION when the server runs without --checkpoint_dir, NOT_FOUND for an
        unknown head.
        """
        response = self._unary(self._stub.Checkpoint, pb.CheckpointRequest(head=head))
        return [HeadCheckpoint(head=h.head, weights_version=h.weights_version,
                               microbatches_since_pull=h.microbatches_since_pull, bytes=h.bytes,
                               write_seconds=h.write_seconds,
                               clients=[ClientProgress.from_proto(c) for c in h.clients])
                for h in response.heads]

    def client_progress(self, head: str, client_id: Optional[str] = None) -> ClientProgress:
        """Acknowledged (applied) and persisted (checkpointed) sequence of `client_id` (default:
        this client's) on `head`. After a server restart, resend exactly the micro-batches
        above `persisted_sequence` (see the proto for when that is exact)."""
        return ClientProgress.from_proto(self._unary(
            self._stub.GetClientProgress,
            pb.GetClientProgressRequest(head=head, client_id=client_id or self.client_id)))

    # -- heads ------------------------------------------------------------------------------
    def create_head(self, name: str, vocab_size: int, hidden_size: int, *,
                    weight_dtype: DTypeLike = torch.bfloat16, init_std: Optional[float] = None,
                    seed: int = 0, default_options: Optional[LossOptions] = None) -> pb.HeadInfo:
        """Creates a head with W = 0, or W ~ N(0, init_std^2) seeded by `seed`."""
        spec = pb.HeadSpec(name=name, vocab_size=int(vocab_size), hidden_size=int(hidden_size),
                           weight_dtype=_wire.to_wire_dtype(weight_dtype))
        if init_std is None:
            spec.init.zeros = True
        else:
            spec.init.normal.std = float(init_std)
            spec.init.normal.seed = int(seed)
        if default_options is not None:
            spec.default_options.CopyFrom(default_options.to_proto())
        return self._unary(self._stub.CreateHead, pb.CreateHeadRequest(spec=spec))

    def get_head(self, name: str) -> pb.HeadInfo:
        return self._unary(self._stub.GetHead, pb.GetHeadRequest(name=name))

    def list_heads(self) -> List[pb.HeadInfo]:
        return list(self._unary(self._stub.ListHeads, pb.ListHeadsRequest()).heads)

    def delete_head(self, name: str) -> None:
        self._unary(self._stub.DeleteHead, pb.DeleteHeadRequest(name=name))

    def set_loss_options(self, name: str, options: LossOptions) -> pb.HeadInfo:
        """Replaces the head's default loss options."""
        return self._unary(self._stub.SetLossOptions, pb.SetLossOptionsRequest(
            name=name, default_options=options.to_proto()))

    # -- weights and gradients --------------------------------------------------------------
    def push_weights(self, head: str, data: torch.Tensor, *, add: bool = False,
                     dtype: Optional[DTypeLike] = None,
                     expected_weights_version: Optional[int] = None) -> int:
        """Replaces W with `data` (V x D), or adds it when `add`; returns the new version.

        `dtype` is the wire dtype (default: data's dtype when it is bf16/fp16/fp32, else fp32);
        the server converts to the head's dtype. With `expected_weights_version` the push fails
        with FAILED_PRECONDITION if W has another version.

        A replacement is re-sent whole after a transient failure; a delta (`add`) only with
        `expected_weights_version`, so that a delta that landed cannot be added twice.
        """
        wire = dtype if dtype is not None else (
            data.dtype if data.dtype in (torch.bfloat16, torch.float16, torch.float32)
            else torch.float32)
        header = pb.PushHeader(head=head, dtype=_wire.to_wire_dtype(wire),
                               mode=pb.PUSH_MODE_ADD if add else pb.PUSH_MODE_REPLACE)
        if expected_weights_version is not None:
            header.expected_weights_version = int(expected_weights_version)
        raw = memoryview(_wire.encode(data, wire))
        step = self.piece_bytes

        def requests() -> Iterator[pb.PushWeightsRequest]:
            yield pb.PushWeightsRequest(header=header, offset=0, data=bytes(raw[:step]))
            for off in range(step, len(raw), step):
                yield pb.PushWeightsRequest(offset=off, data=bytes(raw[off:off + step]))

        def once() -> pb.PushWeightsResponse:
            return self._unary_once(self._stub.PushWeights, requests())

        if add and expected_weights_version is None:
            return once().weights_version  # a lost answer must not add the delta twice
        return self._with_retry(once).weights_version

    def upload_weights(self, head: str, weights: torch.Tensor, *,
                       dtype: Optional[DTypeLike] = None,
                       expected_weights_version: Optional[int] = None) -> int:
        """Replaces W (V x D); returns the new weights version."""
        return self.push_weights(head, weights, dtype=dtype,
                                 expected_weights_version=expected_weights_version)

    def download_weights(self, head: str, dtype: Optional[DTypeLike] = None) -> Weights:
        """W (V x D) on the CPU, in `dtype` (default: the head's weight dtype)."""
        return self._with_retry(lambda: self._download_weights_once(head, dtype))

    def _download_weights_once(self, head: str, dtype: Optional[DTypeLike]) -> Weights:
        request = pb.DownloadWeightsRequest(
            head=head, dtype=_wire.to_wire_dtype(dtype) if dtype is not None else 0)
        try:
            chunks = self._stub.DownloadWeights(request, timeout=self.timeout,
                                                metadata=self._metadata)
            first: Optional[pb.WeightsChunk] = None
            buf = bytearray()
            received = 0
            for chunk in chunks:
                if first is None:
                    first = chunk
                    buf = bytearray(chunk.total_bytes)
                buf[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
                received += len(chunk.data)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None
        if first is None or received != first.total_bytes:
            raise LossheadError(grpc.StatusCode.INTERNAL,
                                f"DownloadWeights: {received} of "
                                f"{first.total_bytes if first else '?'} bytes")
        w = _wire.decode(buf, first.dtype, (first.vocab_size, first.hidden_size))
        return Weights(weights=w, version=first.weights_version)

    def pull_gradient(self, head: str, *, reset: bool = False,
                      dtype: DTypeLike = torch.float32) -> Gradient:
        """dW (V x D) accumulated since the last reset, and what it covers.

        With `reset` the accumulator is zeroed atomically: micro-batches that arrive during the
        pull land in the next window.

        Without `reset` a transient failure is retried. With `reset` the pull is never re-sent
        once it may have reached the server (the reset may have happened with the answer lost;
        a second pull would hand back an empty window): the client only waits, with the retry
        policy's backoff, for a connection before the single attempt, and raises a later error
        unchanged; `get_head(head).tokens_since_pull` then tells whether the reset happened.
        """
        if not reset:
            return self._with_retry(lambda: self._pull_gradient_once(head, reset, dtype))
        self._wait_for_connection()
        return self._pull_gradient_once(head, reset, dtype)

    def _pull_gradient_once(self, head: str, reset: bool, dtype: DTypeLike) -> Gradient:
        request = pb.PullGradientRequest(head=head, dtype=_wire.to_wire_dtype(dtype), reset=reset)
        try:
            summary: Optional[pb.GradientSummary] = None
            buf = bytearray()
            received = 0
            for chunk in self._stub.PullGradient(request, timeout=self.timeout,
                                                 metadata=self._metadata):
                if summary is None:
                    summary = chunk.summary
                    buf = bytearray(summary.total_bytes)
                buf[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
                received += len(chunk.data)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None
        if summary is None or received != summary.total_bytes:
            raise LossheadError(grpc.StatusCode.INTERNAL,
                                f"PullGradient: {received} of "
                                f"{summary.total_bytes if summary else '?'} bytes")
        grad = _wire.decode(buf, summary.dtype, (summary.vocab_size, summary.hidden_size))
        return Gradient(grad=grad, summary=GradientSummary(
            vocab_size=summary.vocab_size, hidden_size=summary.hidden_size,
            token_count=summary.token_count, microbatch_count=summary.microbatch_count,
            min_weights_version=summary.min_weights_version,
            max_weights_version=summary.max_weights_version, was_reset=summary.was_reset))

    # -- steps ------------------------------------------------------------------------------
    def open_step_stream(self) -> StepStream:
        """A raw Step stream, for callers that schedule micro-batches themselves."""
        return StepStream(self)

    def microbatch(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
                   hidden_dtype: Optional[DTypeLike] = None, target_dtype: DTypeLike = torch.int64,
                   reduction: ReductionLike = None, grad_scale: Optional[float] = None,
                   loss_options: Optional[LossOptions] = None,
                   expected_weights_version: Optional[int] = None,
                   return_per_token_loss: bool = False, skip_grad_hidden: bool = False,
                   grad_hidden_dtype: Optional[DTypeLike] = None,
                   sequence: Optional[int] = None, forward_only: bool = False) -> _Microbatch:
        """Encodes one micro-batch: hidden (..., D) and targets (...) flattened to N tokens.

        Nothing is validated here beyond what encoding needs: the server is the judge and
        answers bad input with INVALID_ARGUMENT and friends.
        """
        if hidden.dim() == 0:
            raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT, "hidden must have a last dim D")
        d = hidden.shape[-1]
        h2 = hidden.reshape(-1, d)
        wire_h = hidden_dtype if hidden_dtype is not None else (
            hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
            else torch.bfloat16)
        opts = pb.StepOptions(reduction=to_reduction(reduction),
                              return_per_token_loss=return_per_token_loss,
                              skip_grad_hidden=skip_grad_hidden, forward_only=forward_only)
        if grad_scale is not None:
            opts.grad_scale = float(grad_scale)
        if expected_weights_version is not None:
            opts.expected_weights_version = int(expected_weights_version)
        if grad_hidden_dtype is not None:
            opts.grad_hidden_dtype = _wire.to_wire_dtype(grad_hidden_dtype)
        header = pb.StepHeader(
            head=head, client_id=self.client_id,
            sequence=int(sequence) if sequence is not None else self.next_sequence(),
            num_tokens=h2.shape[0], hidden_dtype=_wire.to_wire_dtype(wire_h),
            target_dtype=_wire.to_wire_dtype(target_dtype), options=opts)
        if loss_options is not None:
            header.loss_options.CopyFrom(loss_options.to_proto())
        return _Microbatch(header=header, hidden=_wire.encode(h2, wire_h),
                           targets=_wire.encode(targets.reshape(-1), target_dtype),
                           hidden_size=d)

    def run_microbatches(self, mbs: Sequence[_Microbatch], *, streams: int = 1,
                         max_inflight: Optional[int] = None) -> List[StepResult]:
        """Runs micro-batches pipelined over `streams` Step streams; results in input order.

        Micro-batch k goes on stream k % streams; each stream has up to `max_inflight` of them
        on the wire (default: all at once; gRPC sends in the background while answers are
        read), so the upload of micro-batch k+1 overlaps the computation and dH download of
        micro-batch k. With one stream and `max_inflight=1`, dW accumulates in the given order.

        Retries follow `self.retry`: a micro-batch refused with a retry hint (backpressure) or
        lost with its call (UNAVAILABLE) is re-sent with its original (client_id, sequence), on
        a fresh stream when the call ended; the server replays those it already counted. The
        first failed micro-batch raises its LossheadError once every micro-batch is settled.
        """
        n_streams = max(1, min(streams, len(mbs)))
        outcomes: List[Optional[_Outcome]] = [None] * len(mbs)
        failures: List[BaseException] = []

        def lane(j: int) -> None:
            try:
                pipeline = _StepPipeline(self, connection=j, depth=max_inflight)
                for i, outcome in pipeline.run((i, mbs[i]) for i in range(j, len(mbs), n_streams)):
                    outcomes[i] = outcome
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                failures.append(e)

        threads = [threading.Thread(target=lane, args=(j,), daemon=True,
                                    name=f"losshead-step-{j}") for j in range(1, n_streams)]
        for t in threads:
            t.start()
        lane(0)
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        for o in outcomes:
            if isinstance(o, LossheadError):
                raise o
        return [o for o in outcomes if isinstance(o, StepResult)]

    def step(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, **options: object
             ) -> StepResult:
        """One micro-batch: loss and dH for hidden (..., D) and targets (...); dW accumulates.

        Options (all optional): hidden_dtype (wire dtype of hidden; default its own dtype, bf16
        for others), target_dtype (int64), reduction ("mean" | "sum" | "none"), grad_scale,
        loss_options (LossOptions), expected_weights_version, return_per_token_loss,
        skip_grad_hidden, grad_hidden_dtype, sequence (reuse one to retry by hand),
        forward_only (evaluation: the loss, and dH unless skip_grad_hidden, without adding to dW
        or to the pull's token and micro-batch counts; never replayed, a retry recomputes; a
        server without it raises UNIMPLEMENTED after having counted the micro-batch).
        Transient failures are retried under the same key (see `run_microbatches`).
        """
        return self.run_microbatches([self.microbatch(head, hidden, targets, **options)])[0]

    def step_stream(self, head: str, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], *,
                    max_inflight: int = 4, return_errors: bool = False, **options: object
                    ) -> Iterator[Union[StepResult, LossheadError]]:
        """Pipelines (hidden, targets) micro-batches over one Step stream, yielding in order.

        Up to `max_inflight` micro-batches are on the wire (or waiting to be yielded) at once.
        Transient failures are retried under the same key as in `run_microbatches`, on a new
        stream when the call ended. A failed micro-batch raises its LossheadError (or is
        yielded, with `return_errors`) and the others go on.
        """
        source = ((k, self.microbatch(head, h, t, **options))  # type: ignore[arg-type]
                  for k, (h, t) in enumerate(batches))
        for _, outcome in _StepPipeline(self, depth=max_inflight).run(source):
            if isinstance(outcome, LossheadError):
                if not return_errors or outcome.sequence is None:
                    raise outcome
            yield outcome

    def step_chunked(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
                     chunk_tokens: int = 4096, streams: int = 2, reduction: ReductionLike = "sum",
                     **options: object) -> StepResult:
        """One large batch as several micro-batches of <= `chunk_tokens` tokens, pipelined.

        Each chunk is its own micro-batch (own sequence number), so the reduction must not
        depend on the chunking: "sum" (default) or "none". For the mean, step with "sum" and
        divide by `token_count`. The combined result carries summed loss and token count, the
        concatenated dH and per-token losses, and the lowest weights version seen.
        """
        red = to_reduction(reduction)
        if red not in (pb.REDUCTION_SUM, pb.REDUCTION_NONE):
            raise ValueError("step_chunked: reduction must be 'sum' or 'none'; the server's mean "
                             "is per micro-batch")
        d = hidden.shape[-1]
        h2, t1 = hidden.detach().reshape(-1, d), targets.detach().reshape(-1)
        wire = options.get("hidden_dtype")
        if wire is not None:
            # One device-to-host copy for the whole batch instead of one per chunk.
            h2 = h2.to(device="cpu", dtype=_wire.to_torch_dtype(wire))  # type: ignore[arg-type]
        t1 = t1.cpu()
        n = h2.shape[0]
        bounds = [(a, min(n, a + chunk_tokens)) for a in range(0, max(n, 1), chunk_tokens)]
        mbs = [self.microbatch(head, h2[a:b], t1[a:b], reduction=red, **options)  # type: ignore[arg-type]
               for a, b in bounds]
        parts = self.run_microbatches(mbs, streams=streams)
        return combine_results(parts)


def combine_results(parts: Sequence[StepResult]) -> StepResult:
    """One StepResult for consecutive chunks of a batch (sums and concatenations)."""
    loss_sum = sum(p.loss_sum for p in parts)
    dhs = [p.grad_hidden for p in parts]
    ptls = [p.per_token_loss for p in parts]
    return StepResult(
        loss=loss_sum, loss_sum=loss_sum, token_count=sum(p.token_count for p in parts),
        weights_version=min(p.weights_version for p in parts),
        replayed=all(p.replayed for p in parts), client_id=parts[0].client_id,
        forward_only=all(p.forward_only for p in parts),
        sequence=parts[0].sequence,
        grad_hidden=torch.cat(dhs) if all(x is not None for x in dhs) else None,  # type: ignore[arg-type]
        per_token_loss=torch.cat(ptls) if all(x is not None for x in ptls) else None)  # type: ignore[arg-type]
