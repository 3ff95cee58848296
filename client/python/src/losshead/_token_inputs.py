"""The per-token inputs of the loss terms (token weights, old and reference log-probs,
advantages) of a batch that `Client.step_chunked` cuts into micro-batches: taken out of its
options as fp32 host tensors, and checked whole before anything is sent."""

from __future__ import annotations

from typing import Dict

import grpc
import torch

from losshead._types import TOKEN_INPUTS
from losshead.errors import LossheadError


def take_token_inputs(options: dict, n: int, targets: torch.Tensor, *,
                      check: bool) -> Dict[str, torch.Tensor]:
    """Pops the token inputs out of `options` (N values each, flattened to fp32 on the host).
    With `check` (a batch cut into several micro-batches), a non-finite value at a counted token
    raises INVALID_ARGUMENT as the server would for its micro-batch, so that no chunk is counted
    while another is refused. The head's default ignore_index is taken to be the built-in one
    unless the options give it: a different head default only makes this check stricter."""
    inputs: Dict[str, torch.Tensor] = {}
    for name, _ in TOKEN_INPUTS:
        value = options.pop(name, None)
        if value is None:
            continue
        t = value.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        if t.numel() != n:
            raise ValueError(f"step_chunked: {name} has {t.numel()} values for {n} tokens")
        inputs[name] = t
    if not (check and inputs):
        return inputs
    ignore = getattr(options.get("loss_options"), "ignore_index", None)
    counted = targets != (-100 if ignore is None else ignore)
    for name, values in inputs.items():
        bad = counted & ~torch.isfinite(values)
        if bool(bad.any()):
            token = int(bad.nonzero()[0])
            raise LossheadError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name}[{token}] = {float(values[token])} is not finite (token {token} is "
                "counted); nothing of the batch was sent")
    return inputs
