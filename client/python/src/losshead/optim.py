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

`JointOptimizer` (losshead.joint) holds a trunk's optimizer and the head as one optimizer, for
training loops that know one (Hugging Face's Trainer, accelerate).

Data parallelism: every rank steps its own micro-batches (`RemoteLMHead`) into the one head,
whose window sums them all, and every rank calls `step()` as with any optimizer under DDP. The
ranks agree first (a barrier: every rank's micro-batches of the step are in the window), rank 0
alone applies, and every rank receives the result, or rank 0's error, before it returns (no
rank's next micro-batch lands in the window being applied). The head is thus stepped exactly
once per step, whatever the number of ranks. The server divides dW by the window's token count,
which makes it the gradient of the mean over all tokens of all ranks: what one process training
on the concatenated batch computes, and what a local head under DDP gets when each rank's loss
is its token sum divided by the global token count (the Trainer's `num_items_in_batch`, whose
loss DDP's averaging then multiplies back). For a trunk of your own loop to match, use
`RemoteLMHead(reduction="sum")` and divide its all-reduced gradients by the all-reduced
`take_token_count()`. `step_with_clipping` clips by the global norm on every rank (the trunk's
gradients are the all-reduced ones under DDP; under FSDP pass `sharded=True` for the sum over
the shards). `local=True` restores the manual recipe: one rank steps, the caller places the
barriers.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from losshead._grad_norm import clip_coefficient, scale_, trunk_squared_norm
from losshead._head_stepper import HeadStepper
from losshead._optimizer_calls import ApplyResult
from losshead.client import Client

__all__ = ["ApplyResult", "RemoteAdamW", "RemoteSGD", "step_with_clipping"]


def _placeholder_device(device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class _RemoteOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose parameters live on a losshead server.

    torch.optim needs a parameter per group: the one group holds an empty placeholder tensor and
    the hyper-parameters. The placeholder carries an empty gradient on `grad_device` (default:
    CUDA when there is one), so that a GradScaler records its (finite) inf check for this
    optimizer and steps it; the head's own gradient never holds the loss scale (the server
    accumulates dW of the unscaled sum), and a non-finite one is refused by the server.

    `step()` applies on the server with the group's current values (see
    `losshead._head_stepper`: exactly once for every rank of a data-parallel job, nothing when no
    micro-batch was sent since the last cut); `last_result` keeps what it returned (None when
    there was nothing to apply). On an error the key is kept, so calling `step()` again retries
    the same apply (a repeat of one that landed is answered with `replayed` set). `zero_grad()`
    discards the open window on the server when micro-batches were sent into it since the last
    step (a step skipped, e.g. by a GradScaler on overflow); nothing crosses the wire.
    `state_dict()` refers to a server snapshot of the head's whole state (the server needs
    --checkpoint_dir), which `load_state_dict()` restores.

    The head's optimizer is set on the server when it is not already of this kind, or always
    with `reset=True` (which discards the server's state). With torch.distributed initialised,
    every rank builds the optimizer and calls step / zero_grad / load_state_dict, as with any
    optimizer under DDP; `local=True` keeps every call in this process (the caller synchronises
    the ranks itself).
    """

    _kind = ""

    def __init__(self, client: Client, head: str, defaults: Dict[str, Any], *,
                 client_id: Optional[str] = None, reset: bool = False,
                 momentum_buffer: bool = False, process_group: Any = None, local: bool = False,
                 grad_device: Any = None) -> None:
        placeholder = torch.zeros(0, device=_placeholder_device(grad_device))
        super().__init__([placeholder], defaults)
        self._placeholder = placeholder
        self._placeholder.grad = torch.zeros_like(placeholder)
        self.client = client
        self.head = head
        self.stepper = HeadStepper(client, head, self._kind, client_id=client_id, reset=reset,
                                   momentum_buffer=momentum_buffer, process_group=process_group,
                                   local=local)

    @property
    def client_id(self) -> str:
        return self.stepper.client_id

    @property
    def step_key(self) -> int:
        return self.stepper.step_key

    @property
    def last_result(self) -> Optional[ApplyResult]:
        return self.stepper.last_result

    def _hyper_parameters(self, group: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             max_norm: Optional[float] = None, trunk_grad_sq_norm: float = 0.0,
             grad_divisor: Optional[float] = None, **_: Any) -> Any:
        """Applies one step on the server; see `Client.apply_optimizer` for the arguments."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != 1:
            raise ValueError("losshead: a remote optimizer has exactly one param group")
        self.stepper.apply(grad_divisor=grad_divisor, max_norm=max_norm,
                           trunk_grad_sq_norm=trunk_grad_sq_norm,
                           **self._hyper_parameters(self.param_groups[0]))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the server's open window when anything was sent into it since the last
        step (see the class docstring)."""
        self.stepper.discard()
        self._placeholder.grad = torch.zeros_like(self._placeholder)

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["losshead"] = self.stepper.state_reference()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        remote = state_dict.pop("losshead", None)
        super().load_state_dict(state_dict)
        self._placeholder.grad = torch.zeros_like(self._placeholder)
        if remote is not None:
            self.stepper.load_reference(remote)


class RemoteAdamW(_RemoteOptimizer):
    """torch.optim.AdamW (amsgrad off) on the server's fp32 master weights.

    A head with an output bias steps b too, with `bias_weight_decay` (None: `weight_decay`, as
    one torch param group holding both would; 0: the usual no-decay group for biases)."""

    _kind = "adamw"

    def __init__(self, client: Client, head: str, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, bias_weight_decay: Optional[float] = None,
                 **kwargs: Any) -> None:
        super().__init__(client, head, dict(lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay,
                                            bias_weight_decay=bias_weight_decay), **kwargs)

    def _hyper_parameters(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return dict(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    bias_weight_decay=group.get("bias_weight_decay"))


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
                       max_norm: float, *, sharded: bool = False) -> float:
    """Clips trunk and head by their global norm, as torch.nn.utils.clip_grad_norm_ over all
    their parameters would, and steps the head.

    The trunk's squared gradient norm (float64; summed over the ranks' shards with `sharded`,
    see `losshead._grad_norm`) goes with the head's apply; the server computes the total norm
    and the coefficient min(1, max_norm / (total + 1e-6)), applies it to the head's step and
    returns it; the trunk's gradients are multiplied by it here. Returns the coefficient (the
    total norm is in `head_optimizer.last_result`). With nothing to apply (no micro-batch since
    the last step) the trunk is clipped by its own norm. Step the trunk's own optimizer
    afterwards. Under data parallelism every rank calls it.
    """
    trunk_sq, grads = trunk_squared_norm(trunk_parameters, sharded=sharded,
                                         ranks=head_optimizer.stepper.ranks)
    head_optimizer.step(max_norm=max_norm, trunk_grad_sq_norm=trunk_sq)
    result = head_optimizer.last_result
    coefficient = (result.clip_coefficient if result is not None
                   else clip_coefficient(max_norm, trunk_sq ** 0.5))
    scale_(grads, coefficient)
    return coefficient
