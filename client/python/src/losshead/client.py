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
from dataclasses import dataclass
from typing import Deque, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import torch

from losshead import _wire
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._proto.losshead.v1 import losshead_pb2_grpc as pb_grpc
from losshead._wire import DTypeLike
from losshead.errors import LossheadError, status_code

ReductionLike = Union[str, int, None]

_REDUCTIONS = {
    None: pb.REDUCTION_UNSPECIFIED, "": pb.REDUCTION_UNSPECIFIED,
    "mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE,
}
# Codes after which resending the same (client_id, sequence) is safe and may succeed: the server
# replays micro-batches it already counted, so a retry never adds to dW twice.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
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
                                client_id=client_id, sequence=sequence)
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
        n = mb.header.num_tokens
        grad_hidden = per_token_loss = None
        if res.grad_hidden_bytes:
            grad_hidden = _wire.decode(dh, res.grad_hidden_dtype, (n, mb.hidden_size))
        if res.per_token_loss_bytes:
            per_token_loss = _wire.decode(ptl, pb.DTYPE_FP32, (n,))
        return StepResult(loss=res.loss, loss_sum=res.loss_sum, token_count=res.token_count,
                          weights_version=res.weights_version, replayed=res.replayed,
                          client_id=client_id, sequence=sequence, grad_hidden=grad_hidden,
                          per_token_loss=per_token_loss)

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


class Client:
    """A connection to one losshead server.

    `client_id` (default: host, pid and a random suffix) and a per-client sequence counter form
    the idempotency key of each micro-batch; a retry resends the same key, so the server
    replays it instead of adding it to dW again. `piece_bytes` bounds the tensor bytes per
    message (below the server's 4 MiB default limit). `timeout` applies to unary calls and
    weight/gradient transfers; Step streams have none. `retries` is how often a micro-batch is
    resent after UNAVAILABLE. `connections` > 1 opens that many TCP connections for Step
    streams (gRPC otherwise multiplexes every stream over one), which carries more bytes when
    chunks are spread over several streams.
    """

    def __init__(self, target: str, *, client_id: Optional[str] = None,
                 channel: Optional[grpc.Channel] = None, timeout: Optional[float] = 300.0,
                 piece_bytes: int = 4 * _MiB - 64 * 1024, retries: int = 3,
                 metadata: Sequence[Tuple[str, str]] = (), connections: int = 1) -> None:
        self.target = target
        self.client_id = client_id or _default_client_id()
        self.timeout = timeout
        self.piece_bytes = int(piece_bytes)
        self.retries = int(retries)
        self._metadata = tuple(metadata) or None
        options = [("grpc.max_receive_message_length", 64 * _MiB),
                   ("grpc.max_send_message_length", 64 * _MiB)]
        self._channel = channel or grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.LossHeadStub(self._channel)
        # A local subchannel pool keeps a channel from sharing its connection with the others.
        self._extra_channels = [] if channel is not None else [
            grpc.insecure_channel(target, options=options + [("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, connections) - 1)]
        self._step_stubs = [self._stub] + [pb_grpc.LossHeadStub(c) for c in self._extra_channels]
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)
        self._seq_lock = threading.Lock()
        self._seq = itertools.count(1)

    # -- plumbing ---------------------------------------------------------------------------
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

    def _unary(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None

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

        return self._unary(self._stub.PushWeights, requests()).weights_version

    def upload_weights(self, head: str, weights: torch.Tensor, *,
                       dtype: Optional[DTypeLike] = None,
                       expected_weights_version: Optional[int] = None) -> int:
        """Replaces W (V x D); returns the new weights version."""
        return self.push_weights(head, weights, dtype=dtype,
                                 expected_weights_version=expected_weights_version)

    def download_weights(self, head: str, dtype: Optional[DTypeLike] = None) -> Weights:
        """W (V x D) on the CPU, in `dtype` (default: the head's weight dtype)."""
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
        """
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
                   sequence: Optional[int] = None) -> _Microbatch:
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
                              skip_grad_hidden=skip_grad_hidden)
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

    def run_microbatches(self, mbs: Sequence[_Microbatch], *, streams: int = 1
                         ) -> List[StepResult]:
        """Runs micro-batches pipelined over `streams` Step streams; results in input order.

        All are submitted at once (gRPC sends in the background while answers are read), so the
        upload of micro-batch k+1 overlaps the computation and dH download of micro-batch k.
        Micro-batches whose call fails with UNAVAILABLE are resent with their original
        (client_id, sequence) on fresh streams, up to `retries` times; the server replays those
        it already counted. The first failed micro-batch raises its LossheadError once every
        micro-batch has been answered.
        """
        results: List[Optional[StepResult]] = [None] * len(mbs)
        errors: List[Optional[LossheadError]] = [None] * len(mbs)
        todo = list(range(len(mbs)))
        for attempt in itertools.count():
            retry: List[int] = []
            n_streams = max(1, min(streams, len(todo)))
            opened = [StepStream(self, connection=j) for j in range(n_streams)]
            try:
                for j, i in enumerate(todo):
                    opened[j % n_streams].submit(mbs[i])
                for j, i in enumerate(todo):
                    try:
                        results[i] = opened[j % n_streams].receive()
                    except LossheadError as e:
                        if e.sequence is None and e.code in _RETRYABLE:
                            retry.append(i)  # the call failed, not the micro-batch
                        else:
                            errors[i] = e
            finally:
                for s in opened:
                    s.close()
            if not retry or attempt >= self.retries:
                for i in retry:
                    errors[i] = LossheadError(grpc.StatusCode.UNAVAILABLE,
                                              f"micro-batch {mbs[i].header.sequence} not "
                                              f"answered after {self.retries} retries")
                break
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
            todo = retry
        for e in errors:
            if e is not None:
                raise e
        return [r for r in results if r is not None]

    def step(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, **options: object
             ) -> StepResult:
        """One micro-batch: loss and dH for hidden (..., D) and targets (...); dW accumulates.

        Options (all optional): hidden_dtype (wire dtype of hidden; default its own dtype, bf16
        for others), target_dtype (int64), reduction ("mean" | "sum" | "none"), grad_scale,
        loss_options (LossOptions), expected_weights_version, return_per_token_loss,
        skip_grad_hidden, grad_hidden_dtype, sequence (reuse one to retry by hand).
        """
        return self.run_microbatches([self.microbatch(head, hidden, targets, **options)])[0]

    def step_stream(self, head: str, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], *,
                    max_inflight: int = 4, return_errors: bool = False, **options: object
                    ) -> Iterator[Union[StepResult, LossheadError]]:
        """Pipelines (hidden, targets) micro-batches over one Step stream, yielding in order.

        Up to `max_inflight` micro-batches are on the wire at once. A failed micro-batch raises
        its LossheadError (or is yielded, with `return_errors`) and the others go on.
        """
        with StepStream(self) as stream:
            it = iter(batches)
            exhausted = False
            while True:
                while not exhausted and stream.pending < max_inflight:
                    try:
                        hidden, targets = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    stream.submit(self.microbatch(head, hidden, targets, **options))
                if not stream.pending:
                    return
                try:
                    yield stream.receive()
                except LossheadError as e:
                    if not return_errors or e.sequence is None:
                        raise
                    yield e

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
        sequence=parts[0].sequence,
        grad_hidden=torch.cat(dhs) if all(x is not None for x in dhs) else None,  # type: ignore[arg-type]
        per_token_loss=torch.cat(ptls) if all(x is not None for x in ptls) else None)  # type: ignore[arg-type]
