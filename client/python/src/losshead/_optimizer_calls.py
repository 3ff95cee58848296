"""The server-side optimizer's two calls, attached to `Client`: `set_optimizer` and
`apply_optimizer`, and the `ApplyResult` the latter returns (see `losshead.optim`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead.client import Client

__all__ = ["ApplyResult", "KINDS"]

KINDS = {"none": pb.OPTIMIZER_NONE, "adamw": pb.OPTIMIZER_ADAMW, "sgd": pb.OPTIMIZER_SGD,
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
    if kind not in KINDS:
        raise ValueError(f"losshead: optimizer kind must be one of {sorted(KINDS)}, got {kind!r}")
    spec = pb.OptimizerSpec(kind=KINDS[kind], momentum_buffer=momentum_buffer)
    return self._unary(self._stub.SetOptimizer, pb.SetOptimizerRequest(head=head, optimizer=spec))


def _apply_optimizer(self: Client, head: str, step_key: int, *, lr: float,
                     weight_decay: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, momentum: float = 0.0, dampening: float = 0.0,
                     nesterov: bool = False, grad_divisor: Optional[float] = None,
                     max_norm: Optional[float] = None, trunk_grad_sq_norm: float = 0.0,
                     expected_weights_version: Optional[int] = None,
                     client_id: Optional[str] = None,
                     bias_weight_decay: Optional[float] = None) -> ApplyResult:
    """One optimizer step on the server, exactly once per (client_id, step_key).

    Keys must increase per client id (default: this client's id). A transient failure is
    retried with the same key: a repeat that reached the server answers the first apply's
    result with `replayed` set and steps nothing. Hyper-parameters not used by the head's
    optimizer are ignored (betas: AdamW and Lion; eps: AdamW; momentum, dampening, nesterov:
    SGD).

    A head with an output bias steps b with the same rule and hyper-parameters, its weight decay
    `bias_weight_decay` (None: `weight_decay`, as torch applies a param group's weight_decay to
    every parameter in it; 0 is the usual "no decay on biases" group). The gradient norm and
    the clipping cover dW and db together.
    """
    params = pb.OptimizerHyperParams(lr=lr, weight_decay=weight_decay, beta1=betas[0],
                                     beta2=betas[1], eps=eps, momentum=momentum,
                                     dampening=dampening, nesterov=nesterov)
    request = pb.ApplyOptimizerRequest(head=head, client_id=client_id or self.client_id,
                                       step_key=int(step_key), params=params,
                                       trunk_grad_sq_norm=float(trunk_grad_sq_norm))
    if bias_weight_decay is not None:
        request.params.bias_weight_decay = float(bias_weight_decay)
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
