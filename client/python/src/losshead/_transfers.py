"""Weights up and down, gradients down: W and dW between the server and CPU tensors.

On the native path the C++ client streams the pieces straight into (or out of) the tensor's
memory with the GIL released; the gRPC path assembles them in Python. Both follow the retry
rules of `losshead.retry`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

import grpc
import torch

from losshead import _wire
from losshead._base import ClientBase
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._types import Gradient, GradientSummary, Weights
from losshead._wire import DTypeLike
from losshead.errors import LossheadError


class Transfers(ClientBase):
    """push_weights, upload_weights, download_weights and pull_gradient of `losshead.Client`."""

    def push_weights(self, head: str, data: torch.Tensor, *, add: bool = False,
                     dtype: Optional[DTypeLike] = None,
                     expected_weights_version: Optional[int] = None,
                     bias: Optional[torch.Tensor] = None) -> int:
        """Replaces W with `data` (V x D), or adds it when `add`; returns the new version.

        A head with an output bias takes b (`bias`, V values) in the same push, sent after W in
        the same wire dtype: W and b change together, in one version. Without `bias` such a head
        answers INVALID_ARGUMENT (the length is not the whole of both), as does a head without
        one given `bias`.

        `dtype` is the wire dtype (default: data's dtype when it is bf16/fp16/fp32, else fp32);
        the server converts to the head's dtype. With `expected_weights_version` the push fails
        with FAILED_PRECONDITION if W has another version.

        A replacement is re-sent whole after a transient failure; a delta (`add`) only with
        `expected_weights_version`, so that a delta that landed cannot be added twice.
        """
        wire = dtype if dtype is not None else (
            data.dtype if data.dtype in (torch.bfloat16, torch.float16, torch.float32)
            else torch.float32)
        self._check_open()
        host = _wire.host_tensor(data, wire)
        if bias is not None:
            if bias.dim() != 1:
                raise ValueError(f"losshead: bias must be one-dimensional (V), got shape "
                                 f"{tuple(bias.shape)}")
            host_bias = _wire.host_tensor(bias, wire)
            if self._natives and self._natives[0].carries_bias:
                # W and b read in place, one stream: b's pieces follow W's.
                return self._natives[0].push_bias(head, host, host_bias,
                                                  _wire.to_wire_dtype(wire), add,
                                                  expected_weights_version)
            # b after W on the wire, for the gRPC path (or a library without the bias calls).
            host = torch.cat([host.reshape(-1), host_bias.reshape(-1)])
        if self._natives and bias is None:
            return self._natives[0].push(head, host, _wire.to_wire_dtype(wire), add,
                                         expected_weights_version)
        header = pb.PushHeader(head=head, dtype=_wire.to_wire_dtype(wire),
                               mode=pb.PUSH_MODE_ADD if add else pb.PUSH_MODE_REPLACE)
        if expected_weights_version is not None:
            header.expected_weights_version = int(expected_weights_version)
        raw = _wire.byte_view(host)
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

    def download_weights(self, head: str, dtype: Optional[DTypeLike] = None, *,
                         out: Optional[torch.Tensor] = None) -> Weights:
        """W (V x D) on the CPU, in `dtype` (default: the head's weight dtype, or `out`'s).

        With `out` (a contiguous CPU tensor of V x D) W is written into it and it is returned:
        reusing one tensor spares the page faults of a fresh gigabyte-sized allocation, which
        cost about as much as the transfer itself.
        """
        if dtype is None and out is not None:
            dtype = out.dtype
        info = self.get_head(head) if self._natives else None
        # A head with a bias: b follows W, which the library writes to a tensor of its own (the
        # gRPC path splits it off, for a library without the bias calls).
        if info is not None and (not info.spec.bias or self._natives[0].carries_bias):
            dt = _wire.to_torch_dtype(dtype if dtype is not None else info.spec.weight_dtype)
            dest = _destination(out, (info.spec.vocab_size, info.spec.hidden_size), dt)
            if not info.spec.bias:
                got = self._natives[0].download_into(head, _wire.to_wire_dtype(dt), dest)
                _check_filled("DownloadWeights", got.dtype, got.vocab_size, got.hidden_size,
                              dest)
                return Weights(weights=dest, version=got.weights_version)
            bias = torch.empty(info.spec.vocab_size, dtype=dt)
            got, bias_bytes = self._natives[0].download_bias_into(
                head, _wire.to_wire_dtype(dt), dest, bias)
            _check_filled("DownloadWeights", got.dtype, got.vocab_size, got.hidden_size, dest)
            _check_bias("DownloadWeights", bias_bytes, bias)
            return Weights(weights=dest, version=got.weights_version, bias=bias)
        w = self._with_retry(lambda: self._download_weights_once(head, dtype))
        if out is None:
            return w
        _destination(out, tuple(w.weights.shape), w.weights.dtype).copy_(w.weights)
        return Weights(weights=out, version=w.version, bias=w.bias)

    def _download_weights_once(self, head: str, dtype: Optional[DTypeLike]) -> Weights:
        request = pb.DownloadWeightsRequest(
            head=head, dtype=_wire.to_wire_dtype(dtype) if dtype is not None else 0)
        first, buf = _assemble("DownloadWeights", lambda: self._stub.DownloadWeights(
            request, timeout=self.timeout, metadata=self._metadata), lambda c: c)
        w, b = _split_bias(buf, first.dtype, first.vocab_size, first.hidden_size, first.bias)
        return Weights(weights=w, version=first.weights_version, bias=b)

    def pull_gradient(self, head: str, *, reset: bool = False, dtype: DTypeLike = torch.float32,
                      out: Optional[torch.Tensor] = None) -> Gradient:
        """dW (V x D) accumulated since the last reset, and what it covers.

        With `reset` the accumulator is zeroed atomically: micro-batches that arrive during the
        pull land in the next window. With `out` (a contiguous CPU tensor of V x D and `dtype`)
        dW is written into it and `grad` is `out`: an optimizer that pulls every step reuses
        one tensor instead of faulting in a fresh 2 GB one each time.

        Without `reset` a transient failure is retried. With `reset` the pull is never re-sent
        once it may have reached the server (the reset may have happened with the answer lost;
        a second pull would hand back an empty window): the client only waits, with the retry
        policy's backoff, for a connection before the single attempt, and raises a later error
        unchanged; `get_head(head).tokens_since_pull` then tells whether the reset happened.
        """
        self._check_open()
        if self._natives:
            # The shape first, so that dW lands in its tensor as it arrives; a head's shape
            # never changes, and a read is retried like any.
            info = self.get_head(head)
            if not info.spec.bias or self._natives[0].carries_bias:
                return self._pull_gradient_native(head, info, reset, dtype, out)
        if not reset:
            g = self._with_retry(lambda: self._pull_gradient_once(head, reset, dtype))
        else:
            self._wait_for_connection()
            g = self._pull_gradient_once(head, reset, dtype)
        if out is None:
            return g
        _destination(out, tuple(g.grad.shape), g.grad.dtype).copy_(g.grad)
        return Gradient(grad=out, summary=g.summary, grad_bias=g.grad_bias)

    def _pull_gradient_once(self, head: str, reset: bool, dtype: DTypeLike) -> Gradient:
        request = pb.PullGradientRequest(head=head, dtype=_wire.to_wire_dtype(dtype), reset=reset)
        summary, buf = _assemble("PullGradient", lambda: self._stub.PullGradient(
            request, timeout=self.timeout, metadata=self._metadata), lambda c: c.summary)
        grad, grad_bias = _split_bias(buf, summary.dtype, summary.vocab_size, summary.hidden_size,
                                      summary.bias)
        return Gradient(grad=grad, grad_bias=grad_bias, summary=GradientSummary(
            vocab_size=summary.vocab_size, hidden_size=summary.hidden_size,
            token_count=summary.token_count, microbatch_count=summary.microbatch_count,
            min_weights_version=summary.min_weights_version,
            max_weights_version=summary.max_weights_version, was_reset=summary.was_reset))

    def _pull_gradient_native(self, head: str, info: pb.HeadInfo, reset: bool,
                              dtype: DTypeLike, out: Optional[torch.Tensor]) -> Gradient:
        dt = _wire.to_torch_dtype(dtype)
        dest = _destination(out, (info.spec.vocab_size, info.spec.hidden_size), dt)
        grad_bias = None
        if info.spec.bias:
            grad_bias = torch.empty(info.spec.vocab_size, dtype=dt)
            s, bias_bytes = self._natives[0].pull_bias_into(head, _wire.to_wire_dtype(dt), reset,
                                                            dest, grad_bias)
            _check_bias("PullGradient", bias_bytes, grad_bias)
        else:
            s = self._natives[0].pull_into(head, _wire.to_wire_dtype(dt), reset, dest)
        _check_filled("PullGradient", s.dtype, s.vocab_size, s.hidden_size, dest)
        return Gradient(grad=dest, grad_bias=grad_bias, summary=GradientSummary(
            vocab_size=s.vocab_size, hidden_size=s.hidden_size, token_count=s.token_count,
            microbatch_count=s.microbatch_count, min_weights_version=s.min_weights_version,
            max_weights_version=s.max_weights_version, was_reset=bool(s.was_reset)))


def _check_bias(method: str, bias_bytes: int, bias: torch.Tensor) -> None:
    """The library wrote all of b (db): a head created with a bias keeps it for life."""
    if bias_bytes != bias.numel() * bias.element_size():
        raise LossheadError(grpc.StatusCode.INTERNAL,
                            f"{method}: the server sent {bias_bytes} bytes of the output bias, "
                            f"expected {bias.numel()} values")


def _split_bias(buf: bytearray, dtype: int, vocab_size: int, hidden_size: int,
                bias: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """W (or dW), V x D, and the b (or db) of V that follows it when `bias`."""
    if not bias:
        return _wire.decode(buf, dtype, (vocab_size, hidden_size)), None
    both = _wire.decode(buf, dtype, (vocab_size * hidden_size + vocab_size,))
    return (both[:vocab_size * hidden_size].view(vocab_size, hidden_size),
            both[vocab_size * hidden_size:])


def _destination(out: Optional[torch.Tensor], shape: Tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """`out` when it can take a V x D tensor of `dtype` in place, a new tensor when it is None;
    ValueError otherwise (nothing has been sent)."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if (out.device.type != "cpu" or out.dtype != dtype or tuple(out.shape) != tuple(shape)
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous CPU tensor of {tuple(shape)} and {dtype}, "
                         f"not {tuple(out.shape)} of {out.dtype} on {out.device}")
    return out


def _check_filled(what: str, dtype: int, vocab_size: int, hidden_size: int,
                  out: torch.Tensor) -> None:
    """The server sent exactly the tensor that `out` was made for."""
    if (_wire.to_torch_dtype(dtype), vocab_size, hidden_size) != (out.dtype, *out.shape):
        raise LossheadError(grpc.StatusCode.INTERNAL,
                            f"{what}: the server sent {vocab_size} x {hidden_size} of wire dtype "
                            f"{dtype}, expected {tuple(out.shape)} of {out.dtype}")


def _assemble(what: str, call: Callable[[], Iterable[Any]], header: Callable[[Any], Any]
              ) -> Tuple[Any, bytearray]:
    """The first chunk's header (`header(chunk)`, which carries total_bytes) and the bytes of
    every chunk placed at its offset; INTERNAL when they do not add up to the total."""
    first: Any = None
    buf = bytearray()
    received = 0
    try:
        for chunk in call():
            if first is None:
                first = header(chunk)
                buf = bytearray(first.total_bytes)
            buf[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
            received += len(chunk.data)
    except grpc.RpcError as e:
        raise LossheadError.from_rpc_error(e) from None
    if first is None or received != first.total_bytes:
        raise LossheadError(grpc.StatusCode.INTERNAL,
                            f"{what}: {received} of {first.total_bytes if first else '?'} bytes")
    return first, buf
