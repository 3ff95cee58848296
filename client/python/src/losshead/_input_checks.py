"""What a step's tensors must be before they are encoded: refused otherwise with
INVALID_ARGUMENT, before anything is sent."""

from __future__ import annotations

import grpc
import torch

from losshead.errors import LossheadError


def invalid_argument(message: str) -> LossheadError:
    """The error of a step refused before anything was sent."""
    return LossheadError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_tensors(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    """What encoding would lose, refused before anything is sent (INVALID_ARGUMENT).

    Encoding converts hidden states to the wire dtype and targets to integer class ids, so an
    integer `hidden` or a floating-point or boolean `targets` would reach the server as valid
    data it could not tell from what was meant.
    """
    if hidden.dim() == 0:
        raise invalid_argument("hidden must have a last dim D")
    if not hidden.is_floating_point():
        raise invalid_argument(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise invalid_argument(
            f"targets must be an integer tensor of class ids, got {targets.dtype}")


def check_pairing(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    """Targets (...) pair with hidden (..., D) token for token: the same leading shape, or
    either side flattened with as many tokens (INVALID_ARGUMENT otherwise, before anything is
    sent). (2, 4) targets against (4, 2, D) hidden states have as many tokens but no pairing.
    """
    lead = tuple(hidden.shape[:-1])
    if tuple(targets.shape) == lead:
        return
    tokens = 1
    for size in lead:
        tokens *= size
    if targets.numel() == tokens and (targets.dim() == 1 or hidden.dim() == 2):
        return
    raise invalid_argument(
        f"targets of shape {tuple(targets.shape)} do not pair with hidden states of shape "
        f"{tuple(hidden.shape)}: targets take hidden's shape without its last dim, {lead}, or "
        f"{tokens} tokens flattened")
