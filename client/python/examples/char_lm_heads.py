"""The three ways train_char_lm.py runs its LM head, behind one small interface.

- `ServerOptimizerHead` (the default): W, dW and the AdamW state live on the losshead server;
  `RemoteAdamW.step` applies the optimizer there and `step_with_clipping` clips trunk and head
  by their global norm. The trainer holds nothing of the head.
- `MirrorHead` (--client-optimizer): the server computes loss, dH and dW, but the optimizer runs
  here on `RemoteHeadOptimizer`'s fp32 mirror of W: pull dW, clip, step, push W, every step.
- `LocalHead` (--compare-local): nn.Linear-style W and F.cross_entropy in this process.

Each has `loss(hidden, targets)`, `step(trunk_parameters, max_norm)` (clips trunk and head
together as torch.nn.utils.clip_grad_norm_ over all their parameters, scales the trunk's
gradients, steps the head; returns the total gradient norm before clipping), `optimizer` (the
head's, for the learning-rate scheduler) and `memory()` (the bytes of the head this process
holds, measured on the tensors themselves).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from losshead import Client, RemoteAdamW, RemoteHeadOptimizer, RemoteLMHead, step_with_clipping

Memory = Dict[str, int]  # "W", "dW", "optimizer state" -> bytes


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_memory(optimizer: torch.optim.Optimizer) -> Memory:
    """What `optimizer` holds of its parameters: the parameters, their gradients, its state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"W": tensor_bytes(params), "dW": tensor_bytes(p.grad for p in params),
            "optimizer state": tensor_bytes(state)}


def mirror_memory(vocab: int, d_model: int) -> Memory:
    """What the mirror path holds for a vocab x d_model head with AdamW: fp32 W, the pulled fp32
    dW and two fp32 moments."""
    n = vocab * d_model * 4
    return {"W": n, "dW": n, "optimizer state": 2 * n}


def _adamw_options(args) -> dict:
    return dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)


def _squared_norm(parameters: Iterable[torch.Tensor]) -> float:
    grads = [p.grad.detach().double() for p in parameters if p.grad is not None]
    return float(sum((g * g).sum() for g in grads))


def _clip_locally(parameters: List[torch.Tensor], max_norm: float) -> float:
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    return _squared_norm(parameters) ** 0.5


class ServerOptimizerHead:
    label = "remote, server AdamW"

    def __init__(self, client: Client, name: str, args) -> None:
        self.module = RemoteLMHead(client, name, wire_dtype=args.wire_dtype,
                                   chunk_tokens=args.chunk_tokens, streams=args.streams)
        self.optimizer = RemoteAdamW(client, name, **_adamw_options(args))

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.module(hidden, targets)

    def step(self, trunk_parameters: List[nn.Parameter], max_norm: float) -> float:
        if max_norm > 0:
            step_with_clipping(self.optimizer, trunk_parameters, max_norm)
        else:
            # No clipping, but the server still reports the norm over trunk and head.
            self.optimizer.step(trunk_grad_sq_norm=_squared_norm(trunk_parameters))
        assert self.optimizer.last_result is not None
        return self.optimizer.last_result.total_grad_norm

    def memory(self) -> Memory:
        # The optimizer's one parameter is torch.optim's empty placeholder and it keeps no state.
        return optimizer_memory(self.optimizer)


class MirrorHead:
    label = "remote, client AdamW (mirror)"

    def __init__(self, client: Client, name: str, args) -> None:
        self.module = RemoteLMHead(client, name, wire_dtype=args.wire_dtype,
                                   chunk_tokens=args.chunk_tokens, streams=args.streams)
        self.mirror = RemoteHeadOptimizer(client, name, device=args.device)
        self.optimizer = torch.optim.AdamW([self.mirror.weight], **_adamw_options(args))
        self._memory: Memory = {}

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.module(hidden, targets)

    def step(self, trunk_parameters: List[nn.Parameter], max_norm: float) -> float:
        self.mirror.pull_gradient()  # weight.grad = dW / tokens
        total = _clip_locally([*trunk_parameters, self.mirror.weight], max_norm)
        self.optimizer.step()
        # Measured while dW is attached; the mirror keeps that buffer for the next pull.
        self._memory = optimizer_memory(self.optimizer)
        self.mirror.push()
        self.mirror.weight.grad = None
        return total

    def memory(self) -> Memory:
        return self._memory


class LocalHead:
    label = "local torch head"

    def __init__(self, weight: torch.Tensor, args) -> None:
        self.weight = nn.Parameter(weight.to(args.device))
        self.optimizer = torch.optim.AdamW([self.weight], **_adamw_options(args))
        self._memory: Memory = {}

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), self.weight)
        return F.cross_entropy(logits.float(), targets.reshape(-1))

    def step(self, trunk_parameters: List[nn.Parameter], max_norm: float) -> float:
        total = _clip_locally([*trunk_parameters, self.weight], max_norm)
        self.optimizer.step()
        self._memory = optimizer_memory(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def memory(self) -> Memory:
        return self._memory
