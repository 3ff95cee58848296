"""A batch cut into several micro-batches, checked whole before any of them is sent.

The server judges each micro-batch alone, and one it refuses (NaN or Inf in its hidden states,
hidden states beyond the head's dtype, a target outside the vocabulary) fails after the others
were counted. So `step_chunked` checks the whole batch for what the server would refuse first,
and a call that fails changes nothing. The head's vocabulary size, dtype and default
ignore_index come from GetHead and are kept per client (`HeadFacts`); a refusal is checked again
against fresh ones before it is raised, since the head may have been recreated or its defaults
changed since.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from losshead import _wire
from losshead._proto.losshead.v1 import losshead_pb2 as pb

_BUILT_IN_IGNORE_INDEX = -100
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class HeadFacts:
    """What the server checks a micro-batch against."""

    vocab_size: int
    dtype: torch.dtype
    default_ignore_index: int  # the head's default, else the built-in one

    @classmethod
    def of(cls, info: pb.HeadInfo) -> "HeadFacts":
        defaults = info.spec.default_options
        ignore = (defaults.ignore_index if defaults.HasField("ignore_index")
                  else _BUILT_IN_IGNORE_INDEX)
        return cls(vocab_size=info.spec.vocab_size,
                   dtype=_wire.to_torch_dtype(info.spec.weight_dtype), default_ignore_index=ignore)


def largest_magnitude(hidden: torch.Tensor) -> float:
    """max |h|: NaN or Inf when any value is (one reduction, on the tensor's device: 0.06 ms for
    8192 x 4096 bf16 on an H100, a quarter of isfinite().all())."""
    return float(torch.linalg.vector_norm(hidden, float("inf")))


def queued_read(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A 0-d CUDA tensor copied to page-locked host memory behind what the current stream has
    queued now, read when asked for: the read waits for that copy only, not for what is queued
    after it."""
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> torch.Tensor:
        copied.synchronize()
        return host
    return read


class DeviceTargets:
    """A cut batch's targets left on their CUDA device (the device path, so that nothing waits
    for the device before the batch is staged): judged there against the facts known when the
    batch was cut (a reduction queued on the current stream). Other facts, or a refusal, whose
    message names the first bad target, bring them to the host."""

    def __init__(self, targets: torch.Tensor, facts: Optional[HeadFacts],
                 ignore_index: Optional[int]) -> None:
        self.tensor = targets
        self._judged: Optional[Callable[[], torch.Tensor]] = None
        if facts is not None:
            self._under = (facts.vocab_size, _ignore(facts, ignore_index))
            self._judged = queued_read(_out_of_range(targets, *self._under).any())

    def fine_under(self, facts: HeadFacts, ignore: int) -> bool:
        """True when no target is out of range under (facts, ignore) as judged on the device;
        False when some is, or when they were judged under other facts (ask the host)."""
        return (self._judged is not None and self._under == (facts.vocab_size, ignore)
                and not bool(self._judged()))


def refusal(facts: HeadFacts, largest: float, targets: Union[torch.Tensor, DeviceTargets],
            ignore_index: Optional[int]) -> Optional[str]:
    """Why the server would refuse some micro-batch of the batch, or None.

    `largest` is `largest_magnitude` of the hidden states as sent (the wire dtype); `targets`
    the batch's class ids on the host, or on the device (`DeviceTargets`); `ignore_index` the
    step's own, if it sets one.
    """
    if not math.isfinite(largest):
        return "hidden contains NaN or Inf"
    # The server rounds the wire dtype to the head's: the largest value overflows first.
    if not math.isfinite(float(torch.tensor(largest, dtype=torch.float64).to(facts.dtype))):
        return (f"hidden overflows the head's dtype {_DTYPE_NAMES[facts.dtype]} (largest "
                f"magnitude {largest:g})")
    ignore = _ignore(facts, ignore_index)
    if isinstance(targets, DeviceTargets):
        if targets.fine_under(facts, ignore):
            return None
        targets = targets.tensor.cpu()
    bad = _out_of_range(targets, facts.vocab_size, ignore)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        return (f"targets[{i}] = {int(targets[i])} is outside [0, {facts.vocab_size}) and is not "
                f"ignore_index {ignore}")
    return None


def _ignore(facts: HeadFacts, ignore_index: Optional[int]) -> int:
    return ignore_index if ignore_index is not None else facts.default_ignore_index


def _out_of_range(targets: torch.Tensor, vocab_size: int, ignore: int) -> torch.Tensor:
    return ((targets < 0) | (targets >= vocab_size)) & (targets != ignore)


class Once:
    """A check that several threads wait on and the first of them runs: every caller returns or
    raises what that one run raised."""

    def __init__(self, check: Callable[[], None]) -> None:
        self._check: Optional[Callable[[], None]] = check
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None

    def __call__(self) -> None:
        with self._lock:
            if self._check is not None:
                try:
                    self._check()
                except BaseException as e:  # noqa: BLE001 - raised in every caller
                    self._error = e
                self._check = None
        if self._error is not None:
            raise self._error
