"""The server-side optimizer: the head's optimizer step runs where W lives.

`Client.set_optimizer` chooses a head's optimizer (its state starts afresh) and
`Client.apply_optimizer` steps it over the gradient window: the server cuts the window as a pull
with reset does, divides dW by its token count (or `grad_divisor`), optionally clips by the
global norm over head and trunk, steps its fp32 master weights and state, bumps the weights
version and zeroes dW, exactly once per (client id, step key). Nothing of W, dW or the state
crosses the wire.

`RemoteAdamW` and `RemoteSGD` are torch.optim.Optimizer subclasses whose single param group
carries the hyper-parameters, so torch.optim.lr_scheduler drives them unchanged; `step()`
applies on the server. `step_with_clipping` clips a trunk and the head together, as
torch.nn.utils.clip_grad_norm_ over all their parameters would. The mirror path
(`RemoteHeadOptimizer`: pull dW, step a local copy of W, push it) stays for optimizers the
server lacks; it moves W and dW over the wire every step and is much slower.

Data parallelism: every rank steps its own micro-batches (`RemoteLMHead`) into the one head,
whose window sums them all. Once every rank has finished its micro-batches of a step (a
barrier; the trunk's gradient all-reduce is one), exactly one rank calls `step()`, and every
rank waits for it (a second barrier) before its next micro-batch, which would otherwise land in
the window being applied. The server divides dW by the window's token count, which makes it the
gradient of the mean over all tokens of all ranks: what one process training on the
concatenated batch computes. For the trunk to match, use `RemoteLMHead(reduction="sum")` and
divide its all-reduced gradients by the all-reduced `take_token_count()`. With clipping, the
applying rank calls `step_with_clipping` on the all-reduced trunk gradients and broadcasts the
coefficient it returns; the other ranks scale their trunk gradients by it
(`losshead.scale_gradients_`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead.client import Client

__all__ = ["ApplyResult", "RemoteAdamW", "RemoteSGD", "step_with_clipping"]

_KINDS = {"none": pb.OPTIMIZER_NONE, "adamw": pb.OPTIMIZER_ADAMW, "sgd": pb.OPTIMIZER_SGD,
          "lion": pb.OPTIMIZER_LION}


@dataclass(frozen=True)
class ApplyResult:
    """What one optimizer apply covered and did (ApplyOptimizerResponse)."""

    token_count: int
    microbatch_count: int
    min_weights_version: int
    max_weights_version: int
    head_grad_norm: float  # of dW / divisor, before clipping
    total_grad_norm: float  # over head and trunk
    clip_coefficient: float  # applied to the head; use it for the trunk
    weights_version: int  # the new version
    optimizer_step: int  # the head's step count after the apply
    replayed: bool  # a repeat of an earlier apply: nothing was stepped

    @classmethod
    def from_proto(cls, r: pb.ApplyOptimizerResponse) -> "ApplyResult":
        w = r.window
        return cls(w.token_count, w.microbatch_count, w.min_weights_version,
                   w.max_weights_version, r.head_grad_norm, r.total_grad_norm,
                   r.clip_coefficient, r.weights_version, r.optimizer_step, r.replayed)


def _set_optimizer(self: Client, head: str, kind: str = "adamw", *,
                   momentum_buffer: bool = False) -> pb.HeadInfo:
    """Replaces the head's optimizer ("adamw", "sgd", "lion" or "none"); its state starts
    afresh from W. SGD needs `momentum_buffer` for a momentum other than 0."""
    if kind not in _KINDS:
        raise ValueError(f"losshead: optimizer kind must be one of {sorted(_KINDS)}, got {kind!r}")
    spec = pb.OptimizerSpec(kind=_KINDS[kind], momentum_buffer=momentum_buffer)
    return self._unary(self._stub.SetOptimizer, pb.SetOptimizerRequest(head=head, optimizer=spec))


def _apply_optimizer(self: Client, head: str, step_key: int, *, lr: float,
                     weight_decay: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, momentum: float = 0.0, dampening: float = 0.0,
                     nesterov: bool = False, grad_divisor: Optional[float] = None,
                     max_norm: Optional[float] = None, trunk_grad_sq_norm: float = 0.0,
                     expected_weights_version: Optional[int] = None,
                     client_id: Optional[str] = None) -> ApplyResult:
    """One optimizer step on the server, exactly once per (client_id, step_key).

    Keys must increase per client id (default: this client's id). A transient failure is
    retried with the same key: a repeat that reached the server answers the first apply's
    result with `replayed` set and steps nothing. Hyper-parameters not used by the head's
    optimizer are ignored (betas: AdamW and Lion; eps: AdamW; momentum, dampening, nesterov:
    SGD).
    """
    params = pb.OptimizerHyperParams(lr=lr, weight_decay=weight_decay, beta1=betas[0],
                                     beta2=betas[1], eps=eps, momentum=momentum,
                                     dampening=dampening, nesterov=nesterov)
    request = pb.ApplyOptimizerRequest(head=head, client_id=client_id or self.client_id,
                                       step_key=int(step_key), params=params,
                                       trunk_grad_sq_norm=float(trunk_grad_sq_norm))
    if grad_divisor is not None:
        request.grad_divisor = float(grad_divisor)
    if max_norm is not None:
        request.max_norm = float(max_norm)
    if expected_weights_version is not None:
        request.expected_weights_version = int(expected_weights_version)
    return ApplyResult.from_proto(self._unary(self._stub.ApplyOptimizer, request))


# The control calls speak grpcio like the client's others; attached here so that the client's
# modules stay as they are.
Client.set_optimizer = _set_optimizer  # type: ignore[attr-defined]
Client.apply_optimizer = _apply_optimizer  # type: ignore[attr-defined]


class _RemoteOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose parameters live on a losshead server.

    torch.optim needs a parameter per group: the one group holds an empty placeholder tensor and
    the hyper-parameters. `step()` applies on the server with the group's current values and
    the next step key; `last_result` keeps what it returned. On an error the key is kept, so
    calling `step()` again retries the same apply (a repeat of one that landed is answered with
    `replayed` set and steps nothing). `state_dict()` adds the client side of the exactly-once
    key (client id and last key) under "losshead"; the optimizer's state itself is on the
    server, in its checkpoints.

    The head's optimizer is set on the server when it is not already of this kind, or always
    with `reset=True` (which discards the server's state).
    """

    _kind = ""

    def __init__(self, client: Client, head: str, defaults: Dict[str, Any], *,
                 client_id: Optional[str] = None, reset: bool = False,
                 momentum_buffer: bool = False) -> None:
        super().__init__([torch.zeros(0)], defaults)
        self.client = client
        self.head = head
        self.client_id = client_id or f"{client.client_id}/optimizer"
        self.step_key = 0
        self.last_result: Optional[ApplyResult] = None
        current = client.get_head(head).spec.optimizer
        if (reset or current.kind != _KINDS[self._kind]
                or current.momentum_buffer != momentum_buffer):
            client.set_optimizer(head, self._kind, momentum_buffer=momentum_buffer)

    def _hyper_parameters(self, group: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             max_norm: Optional[float] = None, trunk_grad_sq_norm: float = 0.0,
             grad_divisor: Optional[float] = None) -> Any:
        """Applies one step on the server; see `Client.apply_optimizer` for the arguments."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != 1:
            raise ValueError("losshead: a remote optimizer has exactly one param group")
        self.last_result = self.client.apply_optimizer(
            self.head, self.step_key + 1, client_id=self.client_id, grad_divisor=grad_divisor,
            max_norm=max_norm, trunk_grad_sq_norm=trunk_grad_sq_norm,
            **self._hyper_parameters(self.param_groups[0]))
        self.step_key += 1
        return loss

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["losshead"] = {"head": self.head, "client_id": self.client_id,
                             "step_key": self.step_key}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        remote = state_dict.pop("losshead", None)
        super().load_state_dict(state_dict)
        if remote is not None:
            self.client_id = remote["client_id"]
            self.step_key = int(remote["step_key"])


class RemoteAdamW(_RemoteOptimizer):
    """torch.optim.AdamW (amsgrad off) on the server's fp32 master weights."""

    _kind = "adamw"

    def __init__(self, client: Client, head: str, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(client, head, dict(lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay), **kwargs)

    def _hyper_parameters(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return dict(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                    weight_decay=group["weight_decay"])


class RemoteSGD(_RemoteOptimizer):
    """torch.optim.SGD on the server; a momentum buffer is kept there when `momentum` != 0."""

    _kind = "sgd"

    def __init__(self, client: Client, head: str, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(client, head, dict(lr=lr, momentum=momentum, dampening=dampening,
                                            weight_decay=weight_decay, nesterov=nesterov),
                         momentum_buffer=momentum != 0, **kwargs)

    def _hyper_parameters(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"], nesterov=group["nesterov"])


def step_with_clipping(head_optimizer: _RemoteOptimizer, trunk_parameters: Iterable[torch.Tensor],
                       max_norm: float) -> float:
    """Clips trunk and head by their global norm, as torch.nn.utils.clip_grad_norm_ over all
    their parameters would, and steps the head.

    The trunk's squared gradient norm (float64) goes with the head's apply; the server computes
    the total norm and the coefficient min(1, max_norm / (total + 1e-6)), applies it to the
    head's step and returns it; the trunk's gradients are multiplied by it here. Returns the
    coefficient (the total norm is in `head_optimizer.last_result`). Step the trunk's own
    optimizer afterwards.
    """
    grads = [p.grad.detach() for p in trunk_parameters if p.grad is not None]
    trunk_sq = sum(float(torch.sum(g.double() * g.double())) for g in grads)
    head_optimizer.step(max_norm=max_norm, trunk_grad_sq_norm=trunk_sq)
    assert head_optimizer.last_result is not None
    coefficient = head_optimizer.last_result.clip_coefficient
    for g in grads:
        g.mul_(coefficient)
    return coefficient
