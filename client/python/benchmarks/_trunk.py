"""A trainer's trunk for the benchmarks: GEMMs queued on the trainer's stream ahead of a head
step, still running when the head is called, as a model's last layers would be."""

from __future__ import annotations

from typing import Callable

import torch


def make_trunk(count: int, d: int, dtype: torch.dtype, device: torch.device
               ) -> Callable[[], object]:
    """What queues `count` GEMMs of (4096 x d) by (d x d) in `dtype` on random data (never
    zeros: they run faster) on the current stream of `device`; nothing when `count` is 0."""
    if count <= 0:
        return lambda: None
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(4096, d, generator=g).to(device, dtype)
    w = (torch.randn(d, d, generator=g) / d ** 0.5).to(device, dtype)

    def trunk() -> torch.Tensor:
        y = x
        for _ in range(count):
            y = y @ w
        return y
    return trunk
