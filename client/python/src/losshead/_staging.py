"""Where a cut batch's tensors wait between the trainer's device and the host.

Step.step_chunked (losshead._steps) sends a CUDA batch's hidden states from pinned host memory,
stream by stream, and brings dH back to the caller's device as each stream finishes: `staged`
and `lane_copies` queue those copies on the caller's CUDA stream and say when a stream's rows
are ready.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from losshead import _wire
from losshead._batch_check import largest_magnitude, queued_read

LaneReady = Optional[Callable[[int], None]]


def lane_copies(grad: torch.Tensor, device: torch.device, bounds: Sequence[Tuple[int, int]],
                streams: int) -> Tuple[torch.Tensor, Callable[[int], None]]:
    """A tensor like `grad` on `device`, and what copies a stream's rows of `grad` into it.

    Stream j carries micro-batches j, j + streams, ... (run_microbatches). The copies are queued
    on the CUDA stream current where step_chunked was called, from the stream's own thread, so
    that whatever the caller queues there afterwards (backward) sees them; `grad` is pinned when
    the batch came from a CUDA tensor, which makes each copy one asynchronous DMA.
    """
    out = torch.empty(grad.shape, dtype=grad.dtype, device=device)
    caller = torch.cuda.current_stream(device)

    def copy(lane: int) -> None:
        with torch.cuda.stream(caller):
            for a, b in bounds[lane::streams]:
                out[a:b].copy_(grad[a:b], non_blocking=grad.is_pinned())
    return out, copy


def staged(hidden: torch.Tensor, dtype: torch.dtype, bounds: Sequence[Tuple[int, int]],
           streams: int, *, measure: bool
            ) -> Tuple[torch.Tensor, LaneReady, Optional[Callable[[], float]]]:
    """`hidden` as a contiguous CPU tensor of `dtype`, and what a stream's sender waits for.

    A CPU tensor is read in place when it already is one (nothing to wait for). A CUDA tensor
    is copied into pinned host memory (torch's caching host allocator reuses it) stream by
    stream, micro-batch k going to stream k % streams: the first stream's micro-batches come
    first, and each stream starts sending once its own rows are on the host instead of after
    the whole batch. With `measure`, the third value gives the hidden states' largest magnitude
    in `dtype` (losshead._batch_check): for a CUDA tensor, one reduction queued ahead of the
    copies, whose value is read only when asked for, so that the caller's work meanwhile
    overlaps it.
    """
    if not hidden.is_cuda:
        host = _wire.host_tensor(hidden, dtype)
        return host, None, (lambda: largest_magnitude(host)) if measure else None
    staged = torch.empty(hidden.shape, dtype=dtype, pin_memory=True)
    copied = []
    # On the tensor's own device: the events must follow the stream the copies are queued on.
    with torch.cuda.device(hidden.device):
        source = hidden.to(dtype)
        read_largest = queued_largest(source) if measure else None
        for lane in range(streams):
            for a, b in bounds[lane::streams]:
                staged[a:b].copy_(source[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            copied.append(event)
    # Freeing a converted `source` now is safe: the copies were queued on the current stream
    # before anything that could reuse its memory.
    return staged, lambda lane: copied[lane].synchronize(), read_largest


def queued_largest(source: torch.Tensor) -> Callable[[], float]:
    """largest_magnitude of a CUDA tensor: one reduction queued on the current stream now, its
    value read when asked for (waiting for the reduction only, not for what was queued after
    it)."""
    read = queued_read(torch.linalg.vector_norm(source, float("inf")))
    return lambda: float(read())
