"""One server-side head stepped exactly once per optimizer step, by one process or by every rank
of a data-parallel job; its window discarded; its whole state saved and restored by reference.

`HeadStepper` is what the torch.optim front ends (`RemoteAdamW`, `RemoteSGD`,
`JointOptimizer`) share:

- `apply`: the ranks agree (a barrier: every rank's micro-batches are in the window), rank 0
  alone applies under its client id and the next step key, and every rank gets the result or
  the error (which is also the barrier after: no rank sends the next step's micro-batches into
  the window being cut). A window without a token (nothing was sent since the last cut, or
  every target was ignored) is not applied, as torch's optimizers skip a parameter without a
  gradient. A transient failure is retried by the client under the same key; a step() called
  again after an error retries the same key too, and one that had landed is answered
  `replayed`.
- `discard`: the same agreement, then rank 0 discards the open window on the server when it
  holds anything (nothing crosses the wire).
- `state_reference` / `load_reference`: a small dict (strings, integers and None, as
  torch.load(weights_only=True) wants) that names a server snapshot of the head's whole state
  (W, the optimizer's fp32 master, moments and step, version, window), written by rank 0 under
  a tag of this run (`<run>-s<optimizer step>-v<weights version>`) the first time a reference
  to that state is asked for (the server needs --checkpoint_dir). Loading it restores that
  snapshot on the server, whatever the server did since, and every rank takes the restored
  version and step; this stepper's own reference, loaded while nothing has changed since, is
  a no-op (accelerate's prepare hands the state dict round once). A head whose optimizer has
  not stepped yet has no state but W, which the model's own weights carry: its reference names
  no snapshot, and loading it resets the optimizer's state and empties the window.

With torch.distributed initialised (and `local` False) every rank must build the stepper and
call `apply`, `discard` and `load_reference` at the same points, as DDP and FSDP demand of the
trunk's optimizer anyway; `state_reference` makes no collective call (the Trainer asks for the
optimizer's state on rank 0 only). `local=True` keeps every call in this process: the caller
synchronises the ranks itself.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Dict, Optional, Tuple

import grpc

from losshead._dist import Ranks
from losshead._optimizer_calls import KINDS, ApplyResult
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._window import tracker
from losshead.client import Client
from losshead.errors import LossheadError

__all__ = ["HeadStepper", "REFERENCE_KEYS"]

# What a reference holds; every value is a str, an int or None.
REFERENCE_KEYS = ("head", "target", "snapshot", "weights_version", "optimizer_step", "run",
                  "generation", "changes", "kind")

_TAG_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class HeadStepper:
    """See the module docstring."""

    def __init__(self, client: Client, head: str, kind: str, *, client_id: Optional[str] = None,
                 reset: bool = False, momentum_buffer: bool = False, process_group: Any = None,
                 local: bool = False) -> None:
        if kind not in KINDS or kind == "none":
            raise ValueError(f"losshead: a head's optimizer kind is one of "
                             f"{sorted(k for k in KINDS if k != 'none')}, got {kind!r}")
        self.client = client
        self.head = head
        self.kind = kind
        self.momentum_buffer = momentum_buffer
        self.ranks = Ranks(process_group, enabled=not local)
        self.window = tracker(client.target, head)
        self._base_client_id = client_id or f"{client.client_id}/optimizer"
        self.step_key = 0
        self.last_result: Optional[ApplyResult] = None

        def set_up() -> Tuple[int, int, str]:
            info = client.get_head(head)
            current = info.spec.optimizer
            if (reset or current.kind != KINDS[kind]
                    or current.momentum_buffer != momentum_buffer):
                info = client.set_optimizer(head, kind, momentum_buffer=momentum_buffer)
            return info.weights_version, info.optimizer_step, uuid.uuid4().hex[:12]

        self.weights_version, self.optimizer_step, self.run = self.ranks.from_leader(set_up)
        # Step keys start at 1 for every stepper: by default each has a client id of its own, so
        # that two optimizers of one client on one head never reuse a key.
        self.client_id = client_id or f"{self._base_client_id}/{self.run}"
        self.generation = 0  # bumped by every change this stepper makes to the head
        self.loads = 0  # load_reference calls (the Trainer's resume looks whether one came)
        self._changes = self.window.changes  # the pushes from this process known here
        self._snapshot: Optional[Tuple[str, int, int]] = None  # (tag, version, step) written
        self.created_snapshots: list = []  # tags this stepper wrote, oldest first
        self.window.steppers += 1

    # -- stepping -----------------------------------------------------------------------------
    def apply(self, *, lr: float, weight_decay: float = 0.0,
              betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
              grad_divisor: Optional[float] = None, max_norm: Optional[float] = None,
              trunk_grad_sq_norm: float = 0.0,
              bias_weight_decay: Optional[float] = None) -> Optional[ApplyResult]:
        """One step of the head for every rank, or None when the window holds no token."""
        key = self.step_key + 1
        # A tied input embedding's gradients sent from this process are in the window first.
        self.window.wait_embedding_grads()
        # The barrier before (every rank's micro-batches of this step are in); whether any rank
        # knows of tokens in the window spares rank 0 a look at it.
        (known,) = self.ranks.agree([1.0 if self.window.pending_tokens else 0.0])

        def call() -> Optional[ApplyResult]:
            if not known and not self._window_open(discard_empty=True):
                return None  # micro-batches sent by other means are found by the look
            return self.client.apply_optimizer(
                self.head, key, client_id=self.client_id, lr=lr, weight_decay=weight_decay,
                betas=betas, eps=eps, momentum=momentum, dampening=dampening,
                nesterov=nesterov, grad_divisor=grad_divisor, max_norm=max_norm,
                trunk_grad_sq_norm=trunk_grad_sq_norm, bias_weight_decay=bias_weight_decay)

        result = self.ranks.from_leader(call)
        self.last_result = result
        if result is None:
            return None
        self.step_key = key
        self._took(result.weights_version, result.optimizer_step)
        return result

    def discard(self) -> Optional[pb.GradientSummary]:
        """Discards the open window on the server when it holds anything; else nothing."""

        def call() -> Optional[pb.GradientSummary]:
            if not self._window_open(discard_empty=False):
                return None
            return self.client.discard_gradient(self.head)

        self.window.wait_embedding_grads()  # discarded with the window, not after it
        self.ranks.agree([0.0])
        summary = self.ranks.from_leader(call)
        if summary is not None:
            self.window.note_cut()
            self.generation += 1
        return summary

    def _window_open(self, *, discard_empty: bool) -> bool:
        """Whether the head's window holds tokens to apply (rank 0). A window of micro-batches
        whose targets were all ignored holds nothing to apply, and is discarded with
        `discard_empty` (a local head's gradient would be zero)."""
        info = self.client.get_head(self.head)
        if info.tokens_since_pull:
            return True
        if discard_empty and info.microbatches_since_pull:
            self.client.discard_gradient(self.head)
        return discard_empty is False and bool(info.microbatches_since_pull)

    def _took(self, weights_version: int, optimizer_step: int) -> None:
        self.weights_version = int(weights_version)
        self.optimizer_step = int(optimizer_step)
        self.window.note_cut(self.weights_version)
        self.generation += 1

    # -- state by reference -------------------------------------------------------------------
    def _refresh(self) -> None:
        """Looks the head's version and step up again when W was pushed from this process."""
        if self.window.changes != self._changes:
            info = self.client.get_head(self.head)
            self.weights_version, self.optimizer_step = info.weights_version, info.optimizer_step
            self._changes = self.window.changes

    def state_reference(self) -> Dict[str, Any]:
        """A reference to the head's state now (see the module docstring); writes the snapshot
        on rank 0 the first time this state is referred to. No collective call."""
        self._refresh()
        ref: Dict[str, Any] = {"head": self.head, "target": self.client.target, "snapshot": None,
                               "weights_version": self.weights_version,
                               "optimizer_step": self.optimizer_step, "run": self.run,
                               "generation": self.generation, "changes": self._changes,
                               "kind": self.kind}
        if self.optimizer_step == 0:
            return ref  # no optimizer state yet: W (in the model's weights) is all there is
        tag = _TAG_SAFE.sub("_", f"{self.run}-s{self.optimizer_step}-v{self.weights_version}")
        if self._snapshot is None or self._snapshot[0] != tag:
            if self.ranks.is_leader:
                self.client.snapshot_head(self.head, tag)
                self.created_snapshots.append(tag)
            self._snapshot = (tag, self.weights_version, self.optimizer_step)
        ref["snapshot"] = tag
        return ref

    def load_reference(self, ref: Dict[str, Any]) -> bool:
        """Puts the head back to the state `ref` names; returns whether anything was done.
        Every rank calls it under data parallelism; rank 0 decides and acts."""
        if ref.get("head") != self.head:
            raise ValueError(f"losshead: this optimizer state belongs to head {ref.get('head')!r}, "
                             f"not {self.head!r}")
        tag = ref.get("snapshot")
        step = int(ref.get("optimizer_step") or 0)
        self.loads += 1

        def act() -> Optional[Tuple[int, int, str]]:
            if (ref.get("run") == self.run and ref.get("generation") == self.generation
                    and ref.get("changes") == self.window.changes):
                return None  # this stepper's own state, unchanged since: nothing to restore
            if tag is None:
                if step != 0:
                    raise ValueError(
                        f"losshead: this optimizer state of head {self.head!r} names no server "
                        f"snapshot and an optimizer at step {step}: it cannot be restored")
                return self._reset_on_leader()
            try:
                info = self.client.restore_head(self.head, tag)
            except LossheadError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
                raise LossheadError(e.code, (
                    f"head {self.head!r} on {self.client.target} has no snapshot {tag!r} "
                    f"(optimizer step {step}): it was deleted, or the server lost its "
                    "--checkpoint_dir; the head cannot be put back to that step "
                    f"({e.message})")) from None
            return info.weights_version, info.optimizer_step, uuid.uuid4().hex[:12]

        outcome = self.ranks.from_leader(act)
        if outcome is None:
            return False
        version, step_now, run = outcome
        self._restarted(run, tag, version, step_now)
        return True

    def reset_state(self) -> None:
        """The head's optimizer state starts afresh (step 0) and its window is emptied; W stays.
        What a checkpoint saved without the optimizer's state resumes to. Every rank calls it."""
        version, step, run = self.ranks.from_leader(self._reset_on_leader)
        self._restarted(run, None, version, step)

    def _reset_on_leader(self) -> Tuple[int, int, str]:
        info = self.client.set_optimizer(self.head, self.kind, momentum_buffer=self.momentum_buffer)
        self.client.discard_gradient(self.head)
        return info.weights_version, info.optimizer_step, uuid.uuid4().hex[:12]

    def _restarted(self, run: str, tag: Optional[str], version: int, step: int) -> None:
        # A fresh run (and client id) after a restore: the server's memory of applied step keys
        # is the snapshot's now, and keys must keep increasing per client id.
        self.run = run
        self.client_id = f"{self._base_client_id}/{run}"
        self.step_key = 0
        self.weights_version = int(version)
        self.optimizer_step = int(step)
        self._snapshot = (tag, self.weights_version, self.optimizer_step) if tag else None
        self.window.note_cut(self.weights_version)
        self._changes = self.window.changes
        self.generation += 1

    def delete_snapshot(self, tag: str) -> bool:
        """Deletes one of the head's snapshots (rank 0's call); False when it was gone."""
        try:
            self.client.delete_snapshot(self.head, tag)
        except LossheadError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        if tag in self.created_snapshots:
            self.created_snapshots.remove(tag)
        return True
