"""The trunk's part of a global gradient norm, and the coefficient that clips by it.

`trunk_squared_norm` is |g|^2 over the given parameters' gradients, as
torch.nn.utils.clip_grad_norm_ would count them, in float64. Gradients that are DTensors (FSDP2,
tensor parallelism) are reduced over their own mesh (`full_tensor` of their norm). Plain
gradients are taken as they are: whole on every rank under DDP (already all-reduced), or, with
`sharded=True` (FSDP1, whose flat parameters hold each rank's own shard), summed over the ranks
of `ranks`. The server adds the head's |dW / tokens|^2 and returns the coefficient
min(1, max_norm / (total + 1e-6)), torch's own formula, which `clip_coefficient` repeats for a
step that has no head gradient.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

import torch

from losshead._dist import Ranks

__all__ = ["clip_coefficient", "scale_", "trunk_squared_norm"]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def trunk_squared_norm(parameters: Iterable[torch.Tensor], *, sharded: bool = False,
                       ranks: Optional[Ranks] = None) -> Tuple[float, List[torch.Tensor]]:
    """(|g|^2 over the gradients, the gradients); see the module docstring."""
    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [g.detach() for g in grads if not _is_dtensor(g)]
    total = 0.0
    if plain:
        by_device: dict = {}
        for g in plain:
            by_device.setdefault(g.device, []).append(g)
        for group in by_device.values():
            norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32)
                                 for g in group])
            total += float(torch.sum(norms.double() ** 2))
    if sharded and ranks is not None:
        (total,) = ranks.agree([total], op="sum")
    for g in grads:
        if _is_dtensor(g):
            norm = torch.linalg.vector_norm(g.detach(), 2).full_tensor()
            total += float(norm.double()) ** 2
    return total, grads


def clip_coefficient(max_norm: Optional[float], total_norm: float) -> float:
    """min(1, max_norm / (total + 1e-6)) as torch's clip_grad_norm_; 1 without max_norm."""
    if max_norm is None or not math.isfinite(max_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_(grads: Iterable[torch.Tensor], coefficient: float) -> None:
    """Multiplies every gradient by `coefficient` in place (nothing to do for 1)."""
    if coefficient == 1.0:
        return
    for g in grads:
        g.detach().mul_(coefficient)
