"""How a batch travels to the server and back: `StepPlan`.

A plan says nothing about what is computed (the loss options and the reduction do): only how
the batch is cut into micro-batches, over how many Step streams they go, how many each stream
keeps on the wire, and in which dtypes hidden states go up and dH comes back. The loss, dH and
dW do not depend on it (each micro-batch is summed on the server and the sums are added up),
only the time a step takes does.

Both Step paths take the same plan: the C++ client through ctypes (`losshead._native`) and the
grpcio path (`losshead._step_stream`) each run one stream's micro-batches with
`NativeClient.step_many(mbs, plan)` / `step_many(client, connection, mbs, plan)`, reading
`plan.lane_depth`; `Client.run_microbatches` deals the micro-batches out over `plan.streams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from losshead import _wire
from losshead._chunk_plan import plan_chunks
from losshead._wire import DTypeLike


@dataclass(frozen=True)
class StepPlan:
    """The transport settings of a step (`RemoteLMHead(..., plan=StepPlan(...))`,
    `losshead.functional.linear_cross_entropy`, `Client.step_chunked(..., plan=...)`).

    - `streams`: Step streams a batch is spread over, micro-batch k on stream k % streams; each
      gets a TCP connection of its own unless the client caps them (`Client(connections=k)`).
    - `chunk_tokens`, `min_chunk_tokens`, `depth`, `edge_tokens`: the cut
      (`losshead._chunk_plan`): micro-batches of at most `chunk_tokens`, `depth` per stream
      where that keeps them at `min_chunk_tokens` or more (the upload of one overlaps the
      computation and download of the previous), and a first and last one of `edge_tokens` so
      that the server starts early and the last answer comes back fast (0: none).
    - `wire_dtype`: the dtype hidden states travel in (bf16, fp16 or fp32); `grad_hidden_dtype`
      the dtype dH comes back in (None: the wire dtype).
    - `max_inflight`: micro-batches each stream keeps on the wire at once (None: all of its
      own; the cut above already bounds them).

    Frozen: a module or a call holds its plan, and `dataclasses.replace` makes another.
    """

    streams: int = 4
    chunk_tokens: int = 2048
    min_chunk_tokens: int = 1024
    depth: int = 4
    edge_tokens: int = 256
    wire_dtype: DTypeLike = torch.bfloat16
    grad_hidden_dtype: Optional[DTypeLike] = None
    max_inflight: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("streams", "chunk_tokens", "min_chunk_tokens", "depth", "edge_tokens"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.max_inflight is not None:
            object.__setattr__(self, "max_inflight", int(self.max_inflight))
        # Refused here, before anything is sent, rather than at the first step.
        for name in ("wire_dtype", "grad_hidden_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not _wire.to_torch_dtype(dtype).is_floating_point:
                raise ValueError(f"losshead: StepPlan.{name} must be a floating-point dtype "
                                 f"(bf16, fp16 or fp32), got {dtype!r}")

    def chunks(self, n: int) -> List[int]:
        """The micro-batch sizes, in order, of a batch of `n` tokens."""
        return plan_chunks(n, streams=self.streams, chunk_tokens=self.chunk_tokens,
                           min_chunk_tokens=self.min_chunk_tokens, depth=self.depth,
                           edge_tokens=self.edge_tokens)

    def lane_depth(self, count: int) -> int:
        """How many of a stream's `count` micro-batches are on the wire at once."""
        return max(1, count if self.max_inflight is None else self.max_inflight)
