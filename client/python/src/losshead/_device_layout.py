"""A call's device micro-batches in one device region: laid out, copied in, dH copied out.

The region (losshead._device_path) holds, for each micro-batch of the call that takes the device
path, its hidden states, its targets and room for its dH, each at an aligned offset. Every copy
into or out of it goes on the micro-batches' `device_stream` (their caller's), whichever lane
thread sends them:

- in: after the region's last copies out (`Region.reusable`, waited for on the device), then
  synchronised before anything is sent, since the server reads the region as soon as a
  reference arrives;
- out: dH, once the call returned (the server synchronised its writes before answering), not
  waited for on the host. What reads dH comes after the copies on the caller's stream, and the
  next call that takes the region waits for them on the device. On the server's own GPU a host
  wait here sat behind the server's kernels (BENCHMARKS.md, "The trainer's host waits").
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from losshead import _wire
from losshead._device_path import DevicePath, Region, aligned
from losshead._microbatch import Microbatch, grad_dtype

# Index of a micro-batch in its call -> (hidden_at, targets_at, grad_at, grad_bytes).
Places = Dict[int, Tuple[int, int, int, int]]


def device_stream(mbs: Sequence[Microbatch]) -> Optional[torch.cuda.Stream]:
    """The stream of the call's device micro-batches (their caller's; they share one), else None
    (torch.cuda.stream then leaves the thread's current stream)."""
    return next((mb.device_stream for mb in mbs if mb.device_hidden is not None), None)


def lay_out(path: DevicePath, mbs: Sequence[Microbatch]) -> Tuple[Optional[Region], Places]:
    """The device micro-batches (Microbatch.device_hidden) laid out in one region of their device
    and copied in, synchronised: (region, places). Without a region (the path refused or out of
    reach) their hidden states come to the host instead, and they go the host's way."""
    wanted = [i for i, mb in enumerate(mbs) if mb.device_hidden is not None]
    if not wanted:
        return None, {}
    device = mbs[wanted[0]].device_hidden.device  # type: ignore[union-attr]
    places: Places = {}
    at = 0
    for i in wanted:
        mb = mbs[i]
        h = mb.header
        grad = 0 if h.options.skip_grad_hidden else (
            max(0, h.num_tokens) * mb.hidden_size * _wire.element_size(grad_dtype(h)))
        hidden_at = at
        targets_at = aligned(hidden_at + _wire.nbytes(mb.hidden))
        grad_at = aligned(targets_at + _wire.nbytes(mb.targets))
        places[i] = (hidden_at, targets_at, grad_at, grad)
        at = aligned(grad_at + grad)
    region = None
    if all(mbs[i].device_hidden.device == device for i in wanted):  # type: ignore[union-attr]
        if path.bus_for(device) is not None:
            region = path.take(device, at)
    with torch.cuda.device(device), torch.cuda.stream(device_stream(mbs)):
        if region is None:
            for i in wanted:
                mb = mbs[i]
                mb.hidden.copy_(mb.device_hidden)  # type: ignore[arg-type]
                if mb.device_targets is not None:
                    mb.targets.copy_(mb.device_targets)
                mb.device_hidden, mb.device_targets = None, None
            return None, {}
        stream = torch.cuda.current_stream()
        if region.reusable is not None:
            stream.wait_event(region.reusable)
        for i, (hidden_at, targets_at, _, _) in places.items():
            mb = mbs[i]
            src = mb.device_hidden.reshape(-1).view(torch.uint8)  # type: ignore[union-attr]
            region.tensor[hidden_at:hidden_at + src.numel()].copy_(src)
            tgt = (mb.device_targets if mb.device_targets is not None
                   else mb.targets).reshape(-1).view(torch.uint8)
            region.tensor[targets_at:targets_at + tgt.numel()].copy_(tgt)
        stream.synchronize()  # every write of the region done before anything is sent
    return region, places


def copy_out(region: Region, places: Places, mbs: Sequence[Microbatch],
             grads: Sequence[Optional[torch.Tensor]], written: Sequence[int]) -> None:
    """dH of each placed micro-batch out of the region into `grads[i]`, where the server wrote
    `written[i]` bytes of it (0: none, as for a failed micro-batch; a size that is not dH's
    whole is left for the caller to report). Queued, not waited for; `region.reusable` marks
    their end."""
    with torch.cuda.device(region.tensor.device), torch.cuda.stream(device_stream(mbs)):
        for i, (_, _, grad_at, _) in places.items():
            dh = grads[i]
            if dh is not None and written[i] and written[i] == _wire.nbytes(dh):
                dh.reshape(-1).view(torch.uint8).copy_(region.tensor[grad_at:grad_at + written[i]])
        region.reusable = torch.cuda.current_stream().record_event()
