"""float64 references built from torch's own linear + cross_entropy, and comparison helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class Reference:
    loss: torch.Tensor           # reduced as asked (per-token for "none")
    per_token: torch.Tensor      # N, 0 at ignored tokens
    grad_hidden: torch.Tensor    # d(loss)/dH for the given upstream gradient
    grad_weight: torch.Tensor    # d(loss)/dW for the given upstream gradient
    token_count: int


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
              reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
              z_loss: float = 0.0, logit_softcap: float = 0.0,
              upstream: Optional[torch.Tensor] = None) -> Reference:
    """Loss and gradients in float64 of linear + cross_entropy (+ soft-cap, + z-loss)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = F.linear(h, w)
    if logit_softcap > 0:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    per_token = F.cross_entropy(logits, targets, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction="none")
    kept = targets != ignore_index
    if z_loss > 0:
        per_token = per_token + z_loss * torch.logsumexp(logits, -1).square() * kept.double()
    count = int(kept.sum())
    if reduction == "none":
        loss = per_token
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / count
    g = upstream.double() if upstream is not None else torch.ones_like(loss)
    loss.backward(g)
    return Reference(loss=loss.detach(), per_token=per_token.detach(), grad_hidden=h.grad,
                     grad_weight=w.grad, token_count=count)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "") -> None:
    """max|a - e| <= rel * max(max|e|, tiny): a tolerance relative to the tensor's scale."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    scale = max(float(e.abs().max()) if e.numel() else 0.0, 1e-12)
    err = float((a - e).abs().max()) if e.numel() else 0.0
    assert err <= rel * scale, f"{what}: max error {err:.3e} > {rel:.1e} x scale {scale:.3e}"


def random_problem(n: int, d: int, v: int, *, seed: int, ignore_fraction: float = 0.0,
                   ignore_index: int = -100, hidden_scale: float = 1.0):
    """Fresh random hidden (N x D), weights (V x D) and targets (N) with some ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g) * hidden_scale
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_fraction > 0:
        mask = torch.rand(n, generator=g) < ignore_fraction
        targets[mask] = ignore_index
    return hidden, weight, targets
