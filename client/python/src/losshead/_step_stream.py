"""The pure-grpcio Step path: micro-batches framed into StepRequest messages by Python, one
stream at a time, and the retry schedule over it (the C++ client's StepMany, in Python).

Used where the native library is absent, or where the caller hands the client its own gRPC
channel (interceptors see every message); otherwise `losshead._native` carries the steps.
"""

from __future__ import annotations

import collections
import queue
import re
import time
from typing import (TYPE_CHECKING, Deque, Dict, Iterator, List, Optional, Sequence, Set,
                    Tuple)

import grpc

from losshead import _wire
from losshead._microbatch import Microbatch, Outcome
from losshead._plan import StepPlan
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._types import StepResult, TokenOutputs, asks_outputs, missing_outputs
from losshead.errors import LossheadError, status_code
from losshead.retry import is_retryable

if TYPE_CHECKING:
    from losshead._base import ClientBase

# The token outputs' StepResponse fields and wire dtypes.
_TOKEN_OUTPUT_FIELDS = {
    "per_token_logprob": pb.DTYPE_FP32, "per_token_entropy": pb.DTYPE_FP32,
    "per_token_lse": pb.DTYPE_FP32, "per_token_argmax": pb.DTYPE_INT32,
}
# The top-k's StepResponse fields and wire dtypes: N x top_k each.
_TOP_K_FIELDS = {"top_k_ids": pb.DTYPE_INT32, "top_k_logprobs": pb.DTYPE_FP32}
# Every payload field of a StepResponse (each with a `<field>_bytes` in StepResult).
_PAYLOADS = ("grad_hidden", "per_token_loss") + tuple(_TOKEN_OUTPUT_FIELDS) + tuple(_TOP_K_FIELDS)
# What ends a redirect to a client id's home, before the home's address.
_HOME_MARKER = "home="


class StepStream:
    """One Step call: micro-batches go out in submission order and come back in that order.

    `submit` only queues; gRPC's own thread frames and sends, so the next micro-batch travels
    while the caller reads the answer of the previous one with `receive`. A failed micro-batch
    raises LossheadError from `receive` and the stream goes on; a failed call raises
    LossheadError from `receive` for every micro-batch still unanswered.
    """

    def __init__(self, client: "ClientBase", connection: int = 0) -> None:
        self._client = client
        self._queue: "queue.Queue[Optional[Microbatch]]" = queue.Queue()
        self._pending: Deque[Microbatch] = collections.deque()
        stub = client._step_stubs[connection % len(client._step_stubs)]
        self._call = stub.Step(self._requests(), metadata=client._metadata)
        self._responses = iter(self._call)
        self._broken: Optional[LossheadError] = None
        self._closed = False
        self._cancelled_here = False  # a CANCELLED end is then ours, not the server's

    def _requests(self) -> Iterator[pb.StepRequest]:
        while True:
            mb = self._queue.get()
            if mb is None:
                return
            yield from mb.messages(self._client.piece_bytes)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, mb: Microbatch) -> None:
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
            self._broken = LossheadError.from_rpc_error(e, cancelled_here=self._cancelled_here)
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
        # Each payload field's bytes, filled in the order its pieces arrive.
        bufs = {f: bytearray(getattr(res, f + "_bytes")) for f in _PAYLOADS}
        filled = dict.fromkeys(_PAYLOADS, 0)
        msg = first
        while True:
            for f in _PAYLOADS:
                piece = getattr(msg, f)
                if piece:
                    at = filled[f]
                    bufs[f][at:at + len(piece)] = piece
                    filled[f] = at + len(piece)
            if msg.last:
                break
            msg = self._next_response()
        short = [f"{filled[f]}/{len(bufs[f])} {f} bytes" for f in _PAYLOADS
                 if filled[f] != len(bufs[f])]
        if short:
            raise LossheadError(grpc.StatusCode.INTERNAL,
                                f"micro-batch {sequence}: got {', '.join(short)}",
                                client_id=client_id, sequence=sequence)
        dh, ptl = bufs["grad_hidden"], bufs["per_token_loss"]
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
        outputs = None
        opts = mb.header.options
        if asks_outputs(opts):
            got = {f: (_wire.decode(bufs[f], dtype, (n,)) if len(bufs[f]) else None)
                   for f, dtype in _TOKEN_OUTPUT_FIELDS.items()}
            k = opts.top_k
            top = {f: (_wire.decode(bufs[f], dtype, (n, k))
                       if k and len(bufs[f]) == 4 * n * k else None)
                   for f, dtype in _TOP_K_FIELDS.items()}
            outputs = TokenOutputs(
                logprob=got["per_token_logprob"], entropy=got["per_token_entropy"],
                lse=got["per_token_lse"], argmax=got["per_token_argmax"],
                correct_count=res.correct_count if res.HasField("correct_count") else None,
                top_k_ids=top["top_k_ids"], top_k_logprobs=top["top_k_logprobs"])
            missing = missing_outputs(opts, outputs, n)
            if missing:
                raise LossheadError(grpc.StatusCode.UNIMPLEMENTED,
                                    f"micro-batch {sequence}: the server answered without "
                                    f"{missing}: it does not know token outputs (it ran the "
                                    "micro-batch without them"
                                    f"{'' if res.forward_only else ' and counted it'})",
                                    client_id=client_id, sequence=sequence)
        return StepResult(loss=res.loss, loss_sum=res.loss_sum, token_count=res.token_count,
                          weights_version=res.weights_version, replayed=res.replayed,
                          client_id=client_id, sequence=sequence, grad_hidden=grad_hidden,
                          per_token_loss=per_token_loss, forward_only=res.forward_only,
                          outputs=outputs, data_path="network")

    def _drain_until_last(self) -> None:
        while not self._next_response().last:
            pass

    def unanswered(self) -> List[Microbatch]:
        return list(self._pending)

    def close(self) -> None:
        """Half-closes the stream; cancels it if micro-batches are still unanswered."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._pending or self._broken is not None:
            self._cancelled_here = True
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

    def __init__(self, client: "ClientBase", connection: int = 0,
                 depth: Optional[int] = None) -> None:
        self._client = client
        self._connection = connection
        self._depth = float("inf") if depth is None else max(1, int(depth))

    def run(self, source: Iterator[Tuple[int, Microbatch]]
            ) -> Iterator[Tuple[int, Outcome]]:
        """(index, micro-batch) pairs in increasing index order -> (index, outcome) pairs."""
        client, policy, depth = self._client, self._client.retry, self._depth
        unsettled: Dict[int, Microbatch] = {}
        attempts: Dict[int, int] = {}
        order: Deque[int] = collections.deque()  # indices taken from `source`, not yet yielded
        held: Dict[int, Outcome] = {}
        todo: List[Tuple[int, float]] = []  # (index, earliest resend time), in scheduling order
        sent: Deque[int] = collections.deque()  # on `stream`, not yet answered
        stream: Optional[StepStream] = None
        exhausted = False

        moved: Set[int] = set()  # sent again at their home after a redirect (once each)

        def settle(i: int, outcome: Outcome) -> bool:
            """Settles or re-queues micro-batch i; True when it goes to its home (the stream's
            other micro-batches are then to be collected and the stream reopened there)."""
            if (isinstance(outcome, LossheadError) and i not in moved
                    and client._follow_home(home_redirect(outcome))):
                # Refused away from its home, counted nowhere: sent there now, not a retry.
                moved.add(i)
                todo.append((i, time.monotonic()))
                return True
            if (isinstance(outcome, LossheadError) and is_retryable(outcome)
                    and attempts[i] < policy.attempts):
                client._count_retry()
                todo.append((i, time.monotonic() + policy.delay(attempts[i], outcome)))
                return False
            del unsettled[i], attempts[i]
            held[i] = outcome
            return False

        def ready() -> Iterator[Tuple[int, Outcome]]:
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
                    outcome: Outcome = stream.receive()  # type: ignore[union-attr]
                except LossheadError as e:
                    outcome = e
                if settle(i, outcome):
                    # The client's steps go to the home from now on: the others on this stream
                    # are answered here first (each refused, or its own answer), then a new
                    # stream opens there.
                    while sent:
                        j = sent.popleft()
                        try:
                            settle(j, stream.receive())  # type: ignore[union-attr]
                        except LossheadError as e:
                            settle(j, e)
                    stream.close()  # type: ignore[union-attr]
                    stream = None
                elif isinstance(outcome, LossheadError) and outcome.sequence is None:
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


def home_redirect(error: LossheadError) -> Optional[str]:
    """The home's address in a FAILED_PRECONDITION that sends a client id's micro-batches to
    their home process (a head held by a group of server processes: "... home=<address>)"),
    else None."""
    if error.code != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    at = error.message.rfind(_HOME_MARKER)
    if at < 0:
        return None
    address = re.split(r"[) ]", error.message[at + len(_HOME_MARKER):], maxsplit=1)[0]
    return address or None


def step_many(client: "ClientBase", connection: int, mbs: Sequence[Microbatch],
              plan: StepPlan) -> List[Outcome]:
    """One stream's micro-batches over the client's `connection`, `plan.lane_depth` of them on
    the wire; outcomes in input order. The native path's counterpart is
    `NativeClient.step_many`, which takes the same plan."""
    outcomes: List[Optional[Outcome]] = [None] * len(mbs)
    pipeline = _StepPipeline(client, connection=connection, depth=plan.lane_depth(len(mbs)))
    for i, outcome in pipeline.run(enumerate(mbs)):
        outcomes[i] = outcome
    return outcomes  # type: ignore[return-value] - the pipeline settles every one
