"""What this process has put into a head's open gradient window, and the warning when nothing
steps it.

The server's dW window of a head fills with every training micro-batch of every process until an
optimizer apply (or a discard) cuts it. A process cannot see the others' micro-batches, but it
knows its own: `WindowTracker` counts the training calls (each of one or more micro-batches)
it made since its last apply, discard or restore of the head (`pending`), which is what an
optimizer needs to know whether there is anything to apply (torch's optimizers likewise skip a
parameter without a gradient).

It also watches the weights version the server reports with each call: when many training
calls in a row ran against the same version, nobody stepped the head, however
the training loop is written (this process, another rank, a mirror). Training still "works" then
(the loss falls with the trunk) while the head never changes and its window grows without
bound, so `UnsteppedHeadWarning` is raised once, naming the head and what steps it. The
threshold adapts to gradient accumulation: at least `threshold` calls, and four times the
longest run seen between two versions.

Trackers are shared by everything in the process that speaks of the same head on the same
server (the modules that step it and the optimizers that apply it), keyed by (target, head).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["DEFAULT_UNSTEPPED_THRESHOLD", "UnsteppedHeadWarning", "WindowTracker", "tracker"]

DEFAULT_UNSTEPPED_THRESHOLD = 256


class UnsteppedHeadWarning(UserWarning):
    """Many training calls ran against the same weights: nothing steps the head."""


class WindowTracker:
    """One head as this process sees it (see the module docstring). Thread-safe."""

    def __init__(self, target: str, head: str) -> None:
        self.target = target
        self.head = head
        self.threshold: Optional[int] = DEFAULT_UNSTEPPED_THRESHOLD
        self.steppers = 0  # optimizers of this process that apply the head
        self.changes = 0  # W replaced from this process outside an optimizer (pushes)
        self._lock = threading.Lock()
        self._pending = 0  # training calls made since the last cut by this process
        self._pending_tokens = 0  # the tokens they counted
        self._version: Optional[int] = None  # the weights version the last one ran against
        self._same_version = 0  # training calls in a row against `_version`
        self._longest = 0  # the longest such run that ended with a new version
        self._warned = False
        # A tied input embedding (losshead.embedding): the factor the head's loss gave its dH in
        # the last backward (the upstream gradient over the reduction's count, a 0-d tensor on
        # dH's device; None before one, or for per-token losses), and the embedding gradients
        # still on their way to the window.
        self.last_grad_scale: Optional[Any] = None
        self._embedding_sends: List[Any] = []

    def note_embedding_send(self, done: Any) -> None:
        """An embedding gradient on its way into the window (a future whose result() raises
        what its send raised)."""
        with self._lock:
            self._embedding_sends = [f for f in self._embedding_sends if not f.done()]
            self._embedding_sends.append(done)

    def wait_embedding_grads(self) -> None:
        """Returns once every embedding gradient sent from this process is in the window;
        raises the first send's error (every send is waited for first)."""
        with self._lock:
            sends, self._embedding_sends = self._embedding_sends, []
        first: Optional[BaseException] = None
        for f in sends:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised below
                if first is None:
                    first = e
        if first is not None:
            raise first

    @property
    def pending(self) -> int:
        """Training calls this process sent into the open window (0 after a cut)."""
        with self._lock:
            return self._pending

    @property
    def pending_tokens(self) -> int:
        """The tokens of those calls."""
        with self._lock:
            return self._pending_tokens

    def note_training(self, calls: int, weights_version: int, tokens: int = 0) -> None:
        """`calls` training calls (of `tokens` tokens) were counted in dW, the last against
        `weights_version`."""
        message = None
        with self._lock:
            self._pending += calls
            self._pending_tokens += tokens
            if weights_version != self._version:
                if self._version is not None:
                    self._longest = max(self._longest, self._same_version)
                self._version = weights_version
                self._same_version = 0
                self._warned = False
            self._same_version += calls
            limit = self._limit()
            if limit is not None and self._same_version >= limit and not self._warned:
                self._warned = True
                message = (
                    f"losshead: head {self.head!r} on {self.target}: {self._same_version} training "
                    f"forward calls ran against weights version {self._version} and nothing has "
                    "stepped the head: its gradient window keeps growing and W never changes. "
                    "Step it once per optimizer step: with the Hugging Face Trainer, "
                    "`offloaded.attach(trainer)` after building it; in a loop of your own, "
                    "`offloaded.optimizer(trunk_optimizer)` (or RemoteAdamW) stepped with the "
                    "trunk's; for evaluation, put the model in eval() mode or use torch.no_grad() "
                    "(forward-only steps)")
        if message is not None:
            warnings.warn(message, UnsteppedHeadWarning, stacklevel=4)

    def _limit(self) -> Optional[int]:
        if not self.threshold:
            return None
        return max(self.threshold, 4 * self._longest)

    def note_push(self) -> None:
        """This process replaced W (an upload): optimizers look up the head's version again."""
        with self._lock:
            self.changes += 1

    def note_cut(self, weights_version: Optional[int] = None) -> int:
        """The window was cut (applied, discarded or restored); returns what was pending."""
        with self._lock:
            pending, self._pending = self._pending, 0
            self._pending_tokens = 0
            if weights_version is not None and weights_version != self._version:
                if self._version is not None and self._same_version:
                    self._longest = max(self._longest, self._same_version)
                self._version = weights_version
                self._same_version = 0
                self._warned = False
            return pending


_trackers: Dict[Tuple[str, str], WindowTracker] = {}
_trackers_lock = threading.Lock()


def tracker(target: str, head: str) -> WindowTracker:
    """The process's tracker of `head` on the server at `target`."""
    with _trackers_lock:
        found = _trackers.get((target, head))
        if found is None:
            found = _trackers[(target, head)] = WindowTracker(target, head)
        return found
