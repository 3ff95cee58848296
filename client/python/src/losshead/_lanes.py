"""Threads that run a step's Step streams beside the caller's, kept from step to step.

Starting a thread costs ~0.3 ms, paid before its stream can send anything; these threads are
started once and then wait for work. They are daemon threads, as per-step threads were: a step
left running (its caller interrupted) never holds up the interpreter's exit.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable, List, Optional, Tuple

_Work = Optional[Tuple[Callable[[], None], threading.Event]]


class LaneThreads:
    """Runs callables on idle threads of its own, starting one when none is idle."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle: List["queue.SimpleQueue[_Work]"] = []  # each idle thread's inbox
        self._started = 0
        self._closed = False

    def run(self, fn: Callable[[], None]) -> threading.Event:
        """Runs `fn` on an idle thread; the event is set once it has returned (or raised: what it
        raises is printed, as for any thread)."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._idle:
                inbox = self._idle.pop()
            else:
                inbox = queue.SimpleQueue()
                self._started += 1
                threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                                 name=f"{self._name}-{self._started}").start()
        inbox.put((fn, done))
        return done

    def close(self) -> None:
        """Idle threads end now, busy ones once their work returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    def _serve(self, inbox: "queue.SimpleQueue[_Work]") -> None:
        while True:
            work = inbox.get()
            if work is None:
                return
            fn, done = work
            try:
                fn()
            except BaseException:  # noqa: BLE001 - fn's own failure; this thread goes on serving
                traceback.print_exc()
            # Idle again before the waiter wakes: its next call finds this thread.
            with self._lock:
                closed = self._closed
                if not closed:
                    self._idle.append(inbox)
            done.set()
            if closed:
                return
