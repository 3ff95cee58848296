"""One micro-batch as both Step paths carry it, and what becomes of it.

A `Microbatch` is encoded once (`losshead._steps`) and then handed to whichever path sends it:
the C++ client through ctypes (`losshead._native`, which reads its tensors in place) or the
gRPC path (`losshead._step_stream`, which frames it with `messages`). Its `Outcome` is a
StepResult or the LossheadError that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple, Union

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

    @property
    def key(self) -> Tuple[str, int]:
        return self.header.client_id, self.header.sequence

    def messages(self, piece_bytes: int) -> Iterator[pb.StepRequest]:
        """Header + pieces + last, each message carrying at most `piece_bytes` of tensor data."""
        hidden, targets = _wire.byte_view(self.hidden), _wire.byte_view(self.targets)
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
