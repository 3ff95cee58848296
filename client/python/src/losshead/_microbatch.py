"""One micro-batch as both Step paths carry it, and what becomes of it.

A `Microbatch` is encoded once (`losshead._steps`) and then handed to whichever path sends it:
the C++ client through ctypes (`losshead._native`, which reads its tensors in place) or the
gRPC path (`losshead._step_stream`, which frames it with `messages`). Its `Outcome` is a
StepResult or the LossheadError that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from losshead import _wire
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._types import StepResult
from losshead.errors import LossheadError

Outcome = Union[StepResult, LossheadError]


@dataclass
class Microbatch:
    """One micro-batch, ready to be framed: its header and its tensors as the wire carries them.

    `hidden` (N x D) and `targets` (N) are contiguous CPU tensors of the header's wire dtypes,
    read in place by whichever path sends them. `grad_hidden_out`, when set, is a contiguous CPU
    tensor (N x D, the expected dH dtype) that the native path writes dH into.
    """

    header: pb.StepHeader
    hidden: torch.Tensor
    targets: torch.Tensor
    hidden_size: int
    grad_hidden_out: Optional[torch.Tensor] = None
    # The per-token fp32 inputs of the loss terms the header names (contiguous CPU float32, N
    # each), by StepRequest field name ("token_weights", "old_logprob", "advantages",
    # "ref_logprob"), in that order. Both paths carry them, read in place.
    token_inputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    # The same-node device path (losshead._device_path): the hidden states as a contiguous CUDA
    # tensor of the wire dtype (N x D), which the native path hands the server from device
    # memory; `hidden` is then a host tensor of the same shape that is filled (from this) only
    # when the device path is out of reach. The gRPC path never sees one (step_chunked sets it
    # only for native clients that offer the path).
    device_hidden: Optional[torch.Tensor] = None
    # With `device_hidden`, the targets as well where the caller's are on the same device (a
    # contiguous CUDA tensor of the wire dtype, N), copied into the region device to device;
    # `targets` is then a stand-in as `hidden` is. Without it they come from `targets`, whose
    # copy from pageable memory waits on the host for everything queued before it on the device
    # (BENCHMARKS.md, "The trainer's host waits").
    device_targets: Optional[torch.Tensor] = None
    # The caller's CUDA stream when `device_hidden` was made: the copies into and out of the
    # device region are queued on it, so that they follow what wrote the hidden states and what
    # reads dH follows them, whichever thread sends the micro-batch.
    device_stream: Optional[torch.cuda.Stream] = None

    @property
    def key(self) -> Tuple[str, int]:
        return self.header.client_id, self.header.sequence

    def messages(self, piece_bytes: int) -> Iterator[pb.StepRequest]:
        """Header + pieces + last, each message carrying at most `piece_bytes` of tensor data."""
        hidden = _wire.byte_view(self.hidden)
        # After the hidden states: the targets, then the token inputs, each in order.
        tails: List[Tuple[str, memoryview]] = [("targets", _wire.byte_view(self.targets))]
        tails += [(name, _wire.byte_view(t)) for name, t in self.token_inputs.items()]
        offsets = [0] * len(tails)
        h_off = 0
        first = True
        while True:
            budget = piece_bytes
            h_piece = hidden[h_off:h_off + budget]
            h_off += len(h_piece)
            budget -= len(h_piece)
            pieces = {}
            for i, (name, data) in enumerate(tails):
                piece = data[offsets[i]:offsets[i] + max(budget, 0)]
                offsets[i] += len(piece)
                budget -= len(piece)
                if len(piece):
                    pieces[name] = bytes(piece)
            last = h_off == len(hidden) and all(
                off == len(data) for off, (_, data) in zip(offsets, tails))
            msg = pb.StepRequest(hidden=bytes(h_piece), last=last, **pieces)
            if first:
                msg.header.CopyFrom(self.header)
                first = False
            yield msg
            if last:
                return


def grad_dtype(header: pb.StepHeader) -> torch.dtype:
    """The dH dtype the server will send (StepOptions.grad_hidden_dtype, else hidden's)."""
    wire = header.options.grad_hidden_dtype or header.hidden_dtype
    return _wire.to_torch_dtype(wire)
