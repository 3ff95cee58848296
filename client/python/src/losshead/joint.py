"""A trunk's torch optimizer and a server-side head stepped as one torch.optim.Optimizer.

Training loops know one optimizer: they build a learning-rate schedule on it, clip before its
step, step it, zero it, save and load its state, and skip its step when a GradScaler found an
overflow. `JointOptimizer` is that optimizer for a model whose LM head lives on a losshead
server:

- `param_groups` are the trunk optimizer's groups (the same dicts) followed by one head group
  with no parameters that carries the head's lr, weight_decay, betas, eps (or SGD's momentum...),
  so a scheduler built on the joint optimizer (warm-up included) drives the head's lr too.
- `clip_grad_norm_(max_norm)` clips trunk and head by one global norm, as
  torch.nn.utils.clip_grad_norm_ over all of a local model's parameters would: the trunk's
  squared norm goes with the head's apply (`losshead._grad_norm`: DTensor and sharded trunks
  too), the server returns the total norm and the coefficient, the trunk's gradients are
  scaled by it, and the total norm is returned. The head is applied right there (the
  coefficient is needed before the trunk steps), so the `step()` that follows steps the trunk
  alone. A non-finite trunk norm (an fp16 overflow that a GradScaler is about to skip)
  applies nothing and discards the head's window.
- `step()` applies the head (unless the clip did) and steps the trunk. Under a GradScaler the
  joint optimizer is stepped only when its trunk gradients are finite; a skipped step leaves
  the window to `zero_grad()` or `end_step()`, which discard it.
- `zero_grad()` zeroes the trunk and discards whatever was sent into the head's window since
  the last step (nothing crosses the wire).
- `state_dict()` is the trunk's, with the head group and a reference to a server snapshot of the
  head's whole state under "losshead" (also in the head group); `load_state_dict()` restores
  both. See `losshead._head_stepper` for the snapshot rules and data parallelism.

Which optimizer the server runs follows the trunk's: torch.optim.AdamW (or Adam without weight
decay) gives "adamw", torch.optim.SGD "sgd"; anything else needs `kind`. Hyper-parameters left
as None are taken from the trunk's first param group (its defaults for betas and eps).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from losshead._grad_norm import clip_coefficient, scale_, trunk_squared_norm
from losshead._head_stepper import HeadStepper
from losshead._optimizer_calls import ApplyResult
from losshead.client import Client

__all__ = ["HEAD_GROUP_KEY", "JointOptimizer", "head_kind"]

HEAD_GROUP_KEY = "losshead_head"  # marks the head's param group (its value: the head's name)
# The head group's weight decay of an output bias, when it differs from weight_decay.
BIAS_WEIGHT_DECAY_KEY = "bias_weight_decay"
_ADAMW_KEYS = ("lr", "weight_decay", "betas", "eps")
_SGD_KEYS = ("lr", "weight_decay", "momentum", "dampening", "nesterov")


def head_kind(trunk: torch.optim.Optimizer) -> str:
    """The server optimizer that matches `trunk`'s class; ValueError when there is none."""
    if isinstance(trunk, torch.optim.AdamW):
        if trunk.defaults.get("amsgrad"):
            raise ValueError("losshead: the server's AdamW has no amsgrad; pass kind='adamw' "
                             "to accept that, or turn amsgrad off")
        return "adamw"
    if isinstance(trunk, torch.optim.Adam) and not any(
            g.get("weight_decay", 0) for g in trunk.param_groups):
        return "adamw"  # Adam without weight decay is AdamW without it
    if isinstance(trunk, torch.optim.SGD):
        return "sgd"
    raise ValueError(
        f"losshead: the server runs AdamW, SGD or Lion on the head; the trunk's optimizer is "
        f"{type(trunk).__name__}. Pass kind='adamw' | 'sgd' | 'lion' (and its hyper-parameters) "
        "for the head")


class JointOptimizer(torch.optim.Optimizer):
    """See the module docstring.

    `trunk`: the torch optimizer of every trained parameter but the head. `client`, `head`: the
    server and head (`OffloadedHead.optimizer` fills them in). `kind` and the hyper-parameters:
    the head's optimizer (None: from the trunk). `grad_divisor`: what dW is divided by (None:
    the window's token count, the token mean over every rank and micro-batch of the step).
    `sharded`: the trunk's plain gradients are each rank's own shard (FSDP1), summed over the
    ranks for the global norm. `process_group`, `local`, `client_id`, `reset`: as
    `losshead.optim.RemoteAdamW`. `bias_weight_decay`: for a head with an output bias, b's
    weight decay (None: the head group's weight_decay, as one torch param group holding W and
    b would; 0: the usual no-decay group of biases, as the Hugging Face Trainer builds it).
    """

    def __init__(self, trunk: torch.optim.Optimizer, client: Client, head: str, *,
                 kind: Optional[str] = None, lr: Optional[float] = None,
                 weight_decay: Optional[float] = None, betas: Optional[Any] = None,
                 eps: Optional[float] = None, momentum: Optional[float] = None,
                 dampening: Optional[float] = None, nesterov: Optional[bool] = None,
                 grad_divisor: Optional[float] = None, sharded: bool = False,
                 process_group: Any = None, local: bool = False,
                 client_id: Optional[str] = None, reset: bool = False,
                 bias_weight_decay: Optional[float] = None) -> None:
        if isinstance(trunk, JointOptimizer):
            raise TypeError("losshead: this optimizer holds the head already")
        kind = kind or head_kind(trunk)
        first = trunk.param_groups[0] if trunk.param_groups else {}
        given = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum,
                     dampening=dampening, nesterov=nesterov)
        fallback = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, momentum=0.0,
                        dampening=0.0, nesterov=False)
        keys = _SGD_KEYS if kind == "sgd" else _ADAMW_KEYS
        head_group: Dict[str, Any] = {}
        for key in keys:
            value = given[key]
            if value is None:
                value = first.get(key, trunk.defaults.get(key, fallback[key]))
            head_group[key] = tuple(value) if key == "betas" else value
        if bias_weight_decay is not None:
            # A head with an output bias: b's decay (unset: the group's weight_decay).
            head_group[BIAS_WEIGHT_DECAY_KEY] = float(bias_weight_decay)
        head_group[HEAD_GROUP_KEY] = head
        # torch.optim's own bookkeeping (hooks, the step profiler) on a group without
        # parameters; the trunk's groups and state are then shared, not copied.
        super().__init__([{"params": [], **head_group}], dict(trunk.defaults))
        self._trunk = trunk
        self._head_group = self.param_groups[0]
        self.client = client
        self.head = head
        self.grad_divisor = grad_divisor
        self.sharded = sharded
        self.stepper = HeadStepper(client, head, kind, client_id=client_id, reset=reset,
                                   momentum_buffer=kind == "sgd" and bool(
                                       head_group.get("momentum")),
                                   process_group=process_group, local=local)
        self._applied: Optional[ApplyResult] = None  # by clip_grad_norm_ in this step
        self._clipped = False  # clip_grad_norm_ ran in this step (applied or skipped)
        self._sync()

    # -- the groups ---------------------------------------------------------------------------
    def _sync(self) -> None:
        self.param_groups = list(self._trunk.param_groups) + [self._head_group]
        self.state = self._trunk.state

    @property
    def trunk(self) -> torch.optim.Optimizer:
        return self._trunk

    @property
    def head_group(self) -> Dict[str, Any]:
        return self._head_group

    @property
    def last_result(self) -> Optional[ApplyResult]:
        """The head's last apply (None when the last step had nothing to apply)."""
        return self.stepper.last_result

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not hasattr(self, "_trunk"):  # torch.optim.Optimizer.__init__ adding the head group
            super().add_param_group(param_group)
            return
        self._trunk.add_param_group(param_group)
        self._sync()

    def _hyper_parameters(self) -> Dict[str, Any]:
        g = self._head_group
        bias = dict(bias_weight_decay=g.get(BIAS_WEIGHT_DECAY_KEY))
        if self.stepper.kind == "sgd":
            return dict(lr=g["lr"], weight_decay=g["weight_decay"], momentum=g["momentum"],
                        dampening=g["dampening"], nesterov=g["nesterov"], **bias)
        return dict(lr=g["lr"], weight_decay=g["weight_decay"], betas=tuple(g["betas"]),
                    eps=g["eps"], **bias)

    def _trunk_parameters(self) -> List[torch.Tensor]:
        return [p for g in self._trunk.param_groups for p in g["params"]]

    # -- clipping and stepping ----------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float,
                        parameters: Optional[Iterable[torch.Tensor]] = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clips trunk and head by their global L2 norm (see the module docstring); returns the
        total norm before clipping, as torch.nn.utils.clip_grad_norm_ does. `parameters`:
        the trunk's (default: those of the trunk's optimizer). max_norm = inf only measures.
        Every rank calls it under data parallelism."""
        if float(norm_type) != 2.0:
            raise ValueError(f"losshead: the server clips by the L2 norm; norm_type={norm_type} "
                             "cannot include the head")
        params = list(parameters) if parameters is not None else self._trunk_parameters()
        trunk_sq, grads = trunk_squared_norm(params, sharded=self.sharded,
                                             ranks=self.stepper.ranks)
        device = grads[0].device if grads else torch.device("cpu")
        limit = None if max_norm is None or math.isinf(max_norm) else float(max_norm)
        if not math.isfinite(trunk_sq):
            # The step is void (a GradScaler skips it): the head's part goes with it.
            self.stepper.discard()
            self._clipped = True
            return torch.tensor(float("nan") if math.isnan(trunk_sq) else float("inf"),
                                device=device)
        if self._applied is not None:
            # Clipped twice in one step: the head is stepped already, at its clipped norm.
            head_sq = (self._applied.head_grad_norm * self._applied.clip_coefficient) ** 2
            total = math.sqrt(trunk_sq + head_sq)
            scale_(grads, clip_coefficient(limit, total))
            return torch.tensor(total, device=device)
        result = self.stepper.apply(grad_divisor=self.grad_divisor, max_norm=limit,
                                    trunk_grad_sq_norm=trunk_sq, **self._hyper_parameters())
        self._clipped = True
        if result is None:
            total = math.sqrt(trunk_sq)
            coefficient = clip_coefficient(limit, total)
        else:
            self._applied = result
            total, coefficient = result.total_grad_norm, result.clip_coefficient
        scale_(grads, coefficient)
        return torch.tensor(total, device=device)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Applies the head (unless `clip_grad_norm_` did in this step) and steps the trunk."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._clipped:
            self.stepper.apply(grad_divisor=self.grad_divisor, **self._hyper_parameters())
        self._applied = None
        self._clipped = False
        self._trunk.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the trunk's gradients and discards the head's window when anything was sent
        into it since the last step."""
        self._trunk.zero_grad(set_to_none=set_to_none)
        self.end_step()

    def end_step(self) -> None:
        """The training step is over: what is still in the head's window (a step skipped on
        overflow) is discarded, and the next clip starts afresh. Every rank calls it."""
        self._applied = None
        self._clipped = False
        self.stepper.discard()

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state = self._trunk.state_dict()
        reference = self.stepper.state_reference()
        head = {k: v for k, v in self._head_group.items() if k != "params"}
        head["params"] = []
        head["losshead"] = reference
        state["param_groups"] = list(state["param_groups"]) + [head]
        state["losshead"] = dict(reference)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        groups = list(state_dict["param_groups"])
        if not groups or HEAD_GROUP_KEY not in groups[-1]:
            raise ValueError("losshead: this state dict has no head group: it was not saved by a "
                             "JointOptimizer (load a trunk's with optimizer.trunk.load_state_dict)")
        saved_head = groups[-1]
        trunk_state = {k: v for k, v in state_dict.items() if k not in ("param_groups", "losshead")}
        trunk_state["param_groups"] = groups[:-1]
        self._trunk.load_state_dict(trunk_state)
        for key, value in saved_head.items():
            if key not in ("params", "losshead"):
                self._head_group[key] = tuple(value) if key == "betas" else value
        self._sync()
        reference = state_dict.get("losshead") or saved_head.get("losshead")
        if reference is None:
            raise ValueError("losshead: this state dict names no server state of the head")
        self.stepper.load_reference(reference)
        self._applied = None
        self._clipped = False
