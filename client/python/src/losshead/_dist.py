"""The few collectives a data-parallel job needs to step one server-side head exactly once.

When torch.distributed is initialised with more than one rank, every rank runs the same
training loop and calls the optimizer's step (and zero_grad, state_dict loads) at the same
points, as DDP, FSDP and accelerate demand anyway. The head must be applied once for all of
them: `Ranks.agree` is the barrier before (every rank's micro-batches of the step are in the
window, and the ranks learn what the others have), `Ranks.from_leader` runs a call on rank 0
alone and hands its outcome, or its error, to every rank (which is also the barrier after:
no rank sends the next step's micro-batches before the apply has cut the window).

Tensors for the collectives live where the group's backend wants them: on the current CUDA
device for NCCL, on the CPU otherwise. Without torch.distributed (or with one rank) every call
is local and costs nothing.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import torch

__all__ = ["Ranks"]

_T = TypeVar("_T")


class _Failure:
    """An exception raised on the leader, carried to the other ranks."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Ranks:
    """The data-parallel ranks that share one head (`group`: a torch.distributed process group,
    default the world)."""

    def __init__(self, group: Any = None, *, enabled: bool = True) -> None:
        self.group = group
        self.enabled = enabled  # False: every call stays in this process

    @property
    def active(self) -> bool:
        return (self.enabled and torch.distributed.is_available()
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size(self.group) > 1)

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank(self.group) if self.active else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def leader(self) -> int:
        """Rank 0 of the group, as a global rank (what broadcast takes)."""
        if self.group is None:
            return 0
        get = getattr(torch.distributed, "get_global_rank", None)
        if get is None:  # torch < 2.0
            from torch.distributed import distributed_c10d as c10d
            return c10d._get_global_rank(self.group, 0)
        return get(self.group, 0)

    def _device(self) -> torch.device:
        backend = str(torch.distributed.get_backend(self.group)).lower()
        if backend == "nccl" or (backend.startswith("cuda:nccl") and "cpu:" not in backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, values: Sequence[float], op: str = "max") -> List[float]:
        """Element-wise max ("max") or sum ("sum") of `values` over the ranks; a barrier."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        ops = torch.distributed.ReduceOp
        torch.distributed.all_reduce(t, op=ops.MAX if op == "max" else ops.SUM, group=self.group)
        return [float(v) for v in t.cpu()]

    def from_leader(self, call: Callable[[], _T]) -> _T:
        """Runs `call` on rank 0 only; every rank returns its result or raises its error."""
        if not self.active:
            return call()
        outcome: Any = None
        if self.is_leader:
            try:
                outcome = call()
            except Exception as e:  # handed to the other ranks, then raised here too
                outcome = _Failure(e)
        outcome = self._broadcast(outcome)
        if isinstance(outcome, _Failure):
            raise outcome.error
        return outcome

    def _broadcast(self, obj: Any) -> Any:
        """broadcast_object_list from rank 0; an outcome that does not pickle goes as its text."""
        if self.is_leader:
            try:
                pickle.dumps(obj)
            except Exception as e:
                what = obj.error if isinstance(obj, _Failure) else obj
                obj = _Failure(RuntimeError(f"losshead: on rank 0: {what!r} (not picklable: {e})"))
        box: List[Optional[Any]] = [obj]
        if self._device().type == "cuda":
            torch.distributed.broadcast_object_list(box, src=self.leader, group=self.group,
                                                    device=self._device())
        else:
            torch.distributed.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]
