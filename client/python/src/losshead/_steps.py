"""Steps: micro-batches of hidden states and targets in, loss and dH out, dW accumulating.

The native path hands each Step stream's micro-batches to the C++ client's StepMany in one
foreign call (GIL released) per stream, one Python thread per stream; hidden states are read
from the tensors in place and dH is written into its result tensor (for a batch from a CUDA
tensor: pinned host memory, so that the copy back to the device is one DMA). The gRPC path
(`losshead._step_stream`) is the fallback, and serves `open_step_stream` and `step_stream`,
whose callers schedule micro-batches one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from losshead import _step_stream, _wire
from losshead._base import ClientBase
from losshead._batch_check import DeviceTargets, HeadFacts, Once, refusal
from losshead._input_checks import check_pairing, check_tensors, invalid_argument
from losshead._microbatch import Microbatch, Outcome
from losshead._plan import StepPlan
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._staging import lane_copies, queued_largest, staged
from losshead._step_stream import StepStream, _StepPipeline
from losshead._token_inputs import take_token_inputs
from losshead._types import (TOKEN_INPUTS, LossOptions, ReductionLike, StepResult,
                             TokenOutputLike, combine_results, to_reduction, to_token_outputs)
from losshead._wire import DTypeLike
from losshead.errors import LossheadError

_WIRE_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_ONE_STREAM = StepPlan(streams=1)


class Steps(ClientBase):
    """The step methods of `losshead.Client`."""

    def _check_cut_batch(self, head: str, largest: float,
                         targets: Union[torch.Tensor, DeviceTargets],
                         ignore_index: Optional[int]) -> None:
        """LossheadError (INVALID_ARGUMENT) when the server would refuse some micro-batch of a
        cut batch (losshead._batch_check): `largest` magnitude of the hidden states as sent,
        `targets` on the host or judged on their device."""
        facts = self._head_facts.get(head)
        why = None if facts is None else refusal(facts, largest, targets, ignore_index)
        if facts is None or why is not None:  # not known yet, or perhaps out of date
            facts = self._head_facts[head] = HeadFacts.of(self.get_head(head))
            why = refusal(facts, largest, targets, ignore_index)
        if why is not None:
            raise invalid_argument(f"{why}; nothing of the batch was sent")

    def open_step_stream(self) -> StepStream:
        """A raw Step stream, for callers that schedule micro-batches themselves."""
        self._check_open()
        return StepStream(self)

    def microbatch(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
                   hidden_dtype: Optional[DTypeLike] = None, target_dtype: DTypeLike = torch.int64,
                   reduction: ReductionLike = None, grad_scale: Optional[float] = None,
                   loss_options: Optional[LossOptions] = None,
                   expected_weights_version: Optional[int] = None,
                   return_per_token_loss: bool = False, skip_grad_hidden: bool = False,
                   grad_hidden_dtype: Optional[DTypeLike] = None,
                   sequence: Optional[int] = None, forward_only: bool = False,
                   token_outputs: Sequence[TokenOutputLike] = (),
                   return_correct_count: bool = False,
                   token_weights: Optional[torch.Tensor] = None,
                   old_logprob: Optional[torch.Tensor] = None,
                   advantages: Optional[torch.Tensor] = None,
                   ref_logprob: Optional[torch.Tensor] = None,
                   top_k: int = 0) -> Microbatch:
        """Encodes one micro-batch: hidden (..., D) and targets (...) flattened to N tokens.

        token_weights, old_logprob, advantages and ref_logprob are the per-token inputs of the
        loss terms (shaped as targets, sent as fp32; see LossOptions for which kind takes
        which). A micro-batch that carries any goes over gRPC (the C ABI does not carry them).

        Nothing is validated here beyond what encoding needs, or would lose (the tensors'
        dtypes: see `check_tensors`): the server is the judge and answers bad input with
        INVALID_ARGUMENT and friends.
        """
        check_tensors(hidden, targets)
        d = hidden.shape[-1]
        h2 = hidden.reshape(-1, d)
        wire_h = hidden_dtype if hidden_dtype is not None else _default_wire(hidden)
        opts = pb.StepOptions(reduction=to_reduction(reduction),
                              return_per_token_loss=return_per_token_loss,
                              skip_grad_hidden=skip_grad_hidden, forward_only=forward_only,
                              token_outputs=to_token_outputs(token_outputs),
                              return_correct_count=return_correct_count, top_k=int(top_k))
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
        given = {"token_weights": token_weights, "old_logprob": old_logprob,
                 "advantages": advantages, "ref_logprob": ref_logprob}
        inputs = {}
        for name, value in TOKEN_INPUTS:
            tensor = given[name]
            if tensor is None:
                continue
            if tensor.numel() != h2.shape[0]:
                raise ValueError(f"{name} has {tensor.numel()} values for {h2.shape[0]} tokens")
            header.token_inputs.append(value)
            inputs[name] = _wire.host_tensor(tensor.detach().reshape(-1), torch.float32)
        return Microbatch(header=header, hidden=_wire.host_tensor(h2, wire_h),
                          targets=_wire.host_tensor(targets.reshape(-1), target_dtype),
                          hidden_size=d, token_inputs=inputs)

    def run_microbatches(self, mbs: Sequence[Microbatch], *, streams: Optional[int] = None,
                         max_inflight: Optional[int] = None,
                         lane_ready: Optional[Callable[[int], None]] = None,
                         lane_done: Optional[Callable[[int], None]] = None,
                         plan: Optional[StepPlan] = None,
                         before_send: Optional[Callable[[], None]] = None) -> List[StepResult]:
        """Runs micro-batches pipelined over `streams` Step streams; results in input order.

        Micro-batch k goes on stream k % streams; each stream has up to `max_inflight` of them
        on the wire (default: all at once; gRPC sends in the background while answers are
        read), so the upload of micro-batch k+1 overlaps the computation and dH download of
        micro-batch k. With one stream and `max_inflight=1`, dW accumulates in the given order.
        `plan` (a StepPlan) gives both instead (its `streams` and `max_inflight`; the
        micro-batches are cut already); the default is one stream. Either path, native or gRPC,
        runs each stream's micro-batches under that one plan.

        Retries follow `self.retry`: a micro-batch refused with a retry hint (backpressure) or
        lost with its call (UNAVAILABLE) is re-sent with its original (client_id, sequence), on
        a fresh stream when the call ended; the server replays those it already counted. The
        first failed micro-batch raises its LossheadError once every micro-batch is settled.
        `lane_ready(j)`, when given, is called on stream j's thread before it sends anything
        (step_chunked waits there for that stream's rows to reach the host); `lane_done(j)`,
        on stream j's thread once its micro-batches are settled without raising (step_chunked
        copies that stream's dH to the device there); `before_send()`, on each stream's thread
        once its micro-batches are staged, before any is sent: what it raises fails the call
        with nothing sent (step_chunked checks a batch on the device path there).
        """
        self._check_open()
        if plan is None:
            plan = _ONE_STREAM if streams in (None, 1) and max_inflight is None else StepPlan(
                streams=1 if streams is None else streams, max_inflight=max_inflight)
        elif streams is not None or max_inflight is not None:
            raise TypeError("run_microbatches: streams and max_inflight are the plan's; give "
                            "them in the StepPlan")
        n_streams = max(1, min(plan.streams, len(mbs)))
        self._open_step_connections(n_streams)
        outcomes: List[Optional[Outcome]] = [None] * len(mbs)
        failures: List[BaseException] = []

        def lane(j: int) -> None:
            try:
                if lane_ready is not None:
                    lane_ready(j)
                indices = range(j, len(mbs), n_streams)
                for i, outcome in zip(indices, self._run_lane(j, [mbs[i] for i in indices],
                                                              plan, before_send)):
                    outcomes[i] = outcome
                if lane_done is not None:
                    lane_done(j)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                failures.append(e)

        # Stream 0 carries the first micro-batch: it starts on this thread at once, the others on
        # threads kept from call to call (losshead._lanes).
        others = [self._lanes.run(lambda j=j: lane(j)) for j in range(1, n_streams)]
        lane(0)
        for done in others:
            done.wait()  # lane() keeps what it raises in `failures`
        if failures:
            raise failures[0]
        for o in outcomes:
            if isinstance(o, LossheadError):
                raise o
        return [o for o in outcomes if isinstance(o, StepResult)]

    def _run_lane(self, j: int, mbs: Sequence[Microbatch], plan: StepPlan,
                  before_send: Optional[Callable[[], None]]) -> List[Outcome]:
        """Stream j's micro-batches, in order, on the native path (the C++ client of connection
        j) or the gRPC one: the same plan either way."""
        if self._natives:
            return self._natives[j % len(self._natives)].step_many(mbs, plan, before_send)
        if before_send is not None:
            before_send()
        return _step_stream.step_many(self, j, mbs, plan)

    def step(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, **options: object
             ) -> StepResult:
        """One micro-batch: loss and dH for hidden (..., D) and targets (...); dW accumulates.

        Options (all optional): hidden_dtype (wire dtype of hidden; default its own dtype, bf16
        for others), target_dtype (int64), reduction ("mean" | "sum" | "none"), grad_scale,
        loss_options (LossOptions), expected_weights_version, return_per_token_loss,
        skip_grad_hidden, grad_hidden_dtype, sequence (reuse one to retry by hand),
        forward_only (evaluation: the loss, and dH unless skip_grad_hidden, without adding to dW
        or to the pull's token and micro-batch counts; never replayed, a retry recomputes; a
        server without it raises UNIMPLEMENTED after having counted the micro-batch),
        token_outputs (any of "logprob", "entropy", "lse", "argmax": per-token outputs of the
        predicted distribution, in `result.outputs`) and return_correct_count (token accuracy:
        `result.outputs.correct_count`, `result.accuracy`) and top_k (0: none; k in [1, 16],
        at most the vocabulary: `result.outputs.top_k_ids` and `top_k_logprobs`, (N, k); above
        that INVALID_ARGUMENT with nothing counted).
        Transient failures are retried under the same key (see `run_microbatches`).

        A CUDA `hidden` goes by the same-node device path where every native connection offers
        it, unless LOSSHEAD_DEVICE_PATH=0 (losshead._device_path; `result.data_path` says
        "device"): the server copies it out of device memory. dH is returned on the host either
        way.
        """
        if hidden.is_cuda and self._natives and all(
                native.device_bus(hidden.device) is not None for native in self._natives):
            wire = _wire.to_torch_dtype(
                options.pop("hidden_dtype", None) or _default_wire(hidden))  # type: ignore[arg-type]
            d = hidden.shape[-1]
            # Host tensors stand in for the hidden states, and for targets on the same device
            # (filled only if the device path turns out to be refused).
            check_tensors(hidden, targets)  # the stand-in's dtype would hide the caller's
            stand_in = torch.empty(hidden.shape, dtype=wire)
            t_dtype = _wire.to_torch_dtype(
                options.get("target_dtype", torch.int64))  # type: ignore[arg-type]
            kept = targets.device == hidden.device
            mb = self.microbatch(head, stand_in, torch.empty(targets.numel(), dtype=t_dtype)
                                 if kept else targets, hidden_dtype=wire,
                                 **options)  # type: ignore[arg-type]
            with torch.cuda.device(hidden.device):
                mb.device_hidden = hidden.detach().reshape(-1, d).to(wire).contiguous()
                mb.device_stream = torch.cuda.current_stream()
                if kept:
                    mb.device_targets = targets.detach().reshape(-1).to(t_dtype)
            result = self.run_microbatches([mb])[0]
            if result.grad_hidden is not None and result.grad_hidden.is_cuda:
                result.grad_hidden = result.grad_hidden.cpu()
            return result
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
        self._check_open()
        source = ((k, self.microbatch(head, h, t, **options))  # type: ignore[arg-type]
                  for k, (h, t) in enumerate(batches))
        for _, outcome in _StepPipeline(self, depth=max_inflight).run(source):
            if isinstance(outcome, LossheadError):
                if not return_errors or outcome.sequence is None:
                    raise outcome
            yield outcome

    def step_chunked(self, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
                     chunk_tokens: Optional[int] = None, streams: Optional[int] = None,
                     reduction: ReductionLike = "sum", chunks: Optional[Sequence[int]] = None,
                     grad_hidden_device: Optional[Union[str, torch.device]] = None,
                     plan: Optional[StepPlan] = None, **options: object) -> StepResult:
        """One large batch as several micro-batches of <= `chunk_tokens` (4096) tokens,
        pipelined over `streams` (2) Step streams.

        `plan` (a StepPlan) gives the cut (`plan.chunks(n)`), the streams and the wire dtypes
        instead: it is how RemoteLMHead steps. `chunks`, `hidden_dtype` and `grad_hidden_dtype`
        given as well take precedence over it (`grad_hidden_dtype=None`: the wire dtype);
        `chunk_tokens` and `streams` are its own (TypeError). `chunks` gives the micro-batches'
        sizes (in order, each >= 1; they must add up to the batch's tokens). Each chunk is its
        own micro-batch (own sequence number), counted or refused on its own by the server, so
        a batch of several is checked whole before anything is sent (losshead._batch_check):
        tensor dtypes, shapes and chunk sizes; NaN or Inf in the hidden states, or values
        beyond the head's dtype; targets outside the vocabulary that are not the ignore_index
        in force. Any of them raises LossheadError (INVALID_ARGUMENT, no `sequence`) with
        nothing counted. The head's V, dtype and default ignore_index come from one GetHead per
        head and client, looked up again after this client's own create_head, delete_head or
        set_loss_options and before a refusal. The reduction must
        not depend on the chunking: "sum" (default) or "none". For the mean, step
        with "sum" and divide by `token_count`. The combined result carries summed loss and token
        count, the concatenated dH and per-token losses, and the lowest weights version seen.

        dH is returned on the host (pinned memory for a CUDA batch), or on `grad_hidden_device`:
        a CUDA device gets each stream's rows as soon as that stream is done, so that the copies
        overlap the streams still running (ordered on the caller's current CUDA stream).
        """
        check_tensors(hidden, targets)
        check_pairing(hidden, targets)
        red = to_reduction(reduction)
        if red not in (pb.REDUCTION_SUM, pb.REDUCTION_NONE):
            raise ValueError("step_chunked: reduction must be 'sum' or 'none'; the server's mean "
                             "is per micro-batch")
        d = hidden.shape[-1]
        flat = hidden.detach().reshape(-1, d)
        n = flat.shape[0]
        wire_given = options.pop("hidden_dtype", None)
        if plan is None:
            plan = StepPlan(streams=2 if streams is None else streams)
            wire_given = wire_given or _default_wire(hidden)
            bounds = _bounds(n, 4096 if chunk_tokens is None else chunk_tokens, chunks)
        else:
            if streams is not None or chunk_tokens is not None:
                raise TypeError("step_chunked: streams and chunk_tokens are the plan's; give "
                                "them in the StepPlan")
            wire_given = wire_given or plan.wire_dtype
            options.setdefault("grad_hidden_dtype", plan.grad_hidden_dtype)
            bounds = _bounds(n, 0, chunks if chunks is not None else plan.chunks(n))
        wire = _wire.to_torch_dtype(wire_given)  # type: ignore[arg-type]
        n_streams = max(1, min(plan.streams, len(bounds)))
        cut = len(bounds) > 1  # one micro-batch is the server's to refuse whole
        # The same-node device path: a CUDA batch that every native connection can hand the
        # server from device memory stays there (losshead._device_path); the host tensor is a
        # stand-in, filled only if the path turns out to be refused.
        device_path = bool(self._natives) and hidden.is_cuda and all(
            native.device_bus(hidden.device) is not None for native in self._natives)
        # So do targets on the same device, checked there; on the host path they go to the host
        # ahead of the hidden states' rows. Either way nothing waits for the device before the
        # batch is staged, unless per-token inputs are checked against the targets on the host.
        ignore = getattr(options.get("loss_options"), "ignore_index", None)
        beside = hidden.is_cuda and targets.device == hidden.device and not any(
            options.get(name) is not None for name, _ in TOKEN_INPUTS)
        t1, device_targets, judged = None, None, None
        if device_path:
            with torch.cuda.device(hidden.device):
                source = flat.to(wire).contiguous()
                h2 = torch.empty((n, d), dtype=wire)
                lane_ready = None
                largest = queued_largest(source) if cut else None
                if beside:
                    device_targets = targets.detach().reshape(-1).to(torch.int64)
                    judged = (DeviceTargets(device_targets, self._head_facts.get(head), ignore)
                              if cut else None)
                    t1 = torch.empty(n, dtype=torch.int64)  # a stand-in, as h2 is
        else:
            if beside:  # each stream's wait for its rows (lane_ready) covers this copy
                with torch.cuda.device(hidden.device):
                    t1 = torch.empty(n, dtype=torch.int64, pin_memory=True)
                    t1.copy_(targets.detach().reshape(-1).to(torch.int64), non_blocking=True)
            h2, lane_ready, largest = staged(flat, wire, bounds, n_streams, measure=cut)
        if t1 is None:
            t1 = targets.detach().reshape(-1).cpu()
        # The per-token inputs of the loss terms, cut as the targets are.
        inputs = take_token_inputs(options, n, t1, check=cut)
        mbs = [self.microbatch(head, h2[a:b], t1[a:b], reduction=red,  # type: ignore[arg-type]
                               hidden_dtype=wire, **{k: v[a:b] for k, v in inputs.items()},
                               **options) for a, b in bounds]
        if device_path:
            caller = torch.cuda.current_stream(hidden.device)
            for mb, (a, b) in zip(mbs, bounds):
                mb.device_hidden, mb.device_stream = source[a:b], caller
                if device_targets is not None:
                    mb.device_targets = device_targets[a:b]
        grad = None
        if self._natives and not options.get("skip_grad_hidden"):
            # The chunks' dH lands in one tensor: no concatenation afterwards (on the device
            # for the device path: the server writes it there).
            grad_dtype = _wire.to_torch_dtype(
                options.get("grad_hidden_dtype") or wire)  # type: ignore[arg-type]
            if device_path:
                grad = torch.empty((n, d), dtype=grad_dtype, device=hidden.device)
            else:
                grad = torch.empty((n, d), dtype=grad_dtype, pin_memory=hidden.is_cuda)
            for mb, (a, b) in zip(mbs, bounds):
                mb.grad_hidden_out = grad[a:b]
        target = torch.device(grad_hidden_device) if grad_hidden_device is not None else None
        on_device, lane_done = None, None
        if grad is not None and grad.is_cuda:
            # dH is on the batch's device already: the caller's device, or the host by default.
            if target is None:
                target = torch.device("cpu")
        elif grad is not None and target is not None and target.type == "cuda":
            on_device, lane_done = lane_copies(grad, target, bounds, n_streams)
        before_send = None
        if largest is not None:  # the last thing before sending: the reduction had time to run
            def check() -> None:
                self._check_cut_batch(head, largest(), t1 if judged is None else judged, ignore)
            if device_path or lane_ready is not None:
                # On each stream's thread once its micro-batches are staged (in their device
                # region, or their rows on the host), by the first to get there: the reduction
                # and the targets' copy were queued ahead of the copies, so the copies' one wait
                # for the device covers them (a GPU shared with the server makes each wait long:
                # BENCHMARKS.md, "The trainer's host waits").
                before_send = Once(check)
            else:
                check()
        parts = self.run_microbatches(mbs, plan=plan, lane_ready=lane_ready,
                                      lane_done=lane_done, before_send=before_send)
        if grad is None or any(p.grad_hidden is None for p in parts):
            combined = combine_results(parts)
            if target is not None and combined.grad_hidden is not None:
                combined.grad_hidden = combined.grad_hidden.to(target)
            return combined
        combined = combine_results([dataclasses.replace(p, grad_hidden=None) for p in parts])
        if on_device is not None:
            combined.grad_hidden = on_device
        elif target is not None and target.type == "cpu" and grad.is_cuda:
            # dH of the device path, returned on the host as the host path returns it: pinned.
            combined.grad_hidden = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
            combined.grad_hidden.copy_(grad)
        elif target is not None:
            combined.grad_hidden = grad.to(target, non_blocking=grad.is_pinned())
        else:
            combined.grad_hidden = grad
        return combined


def _default_wire(hidden: torch.Tensor) -> torch.dtype:
    """Hidden states travel in their own dtype when the wire has it, else in bf16."""
    return hidden.dtype if hidden.dtype in _WIRE_FLOATS else torch.bfloat16


def _bounds(n: int, chunk_tokens: int, chunks: Optional[Sequence[int]]) -> List[Tuple[int, int]]:
    """[start, end) of each micro-batch: `chunks` as given, else pieces of `chunk_tokens`."""
    if chunks is None:
        step = max(1, chunk_tokens)
        return [(a, min(n, a + step)) for a in range(0, max(n, 1), step)]
    sizes = [int(c) for c in chunks]
    # An empty micro-batch is refused by the server after the others were counted: refused here,
    # before anything is sent.
    if not sizes or sum(sizes) != n or any(c < 1 for c in sizes):
        raise ValueError(f"step_chunked: chunks {sizes} must be sizes >= 1 adding up to the "
                         f"batch's {n} tokens")
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends)]
