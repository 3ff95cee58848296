"""Where the trainer's host waits inside a RemoteLMHead step, call by call.

Starts nothing: give it a running server. It wraps the calls through which the Python client
can block on a device (a stream's or an event's synchronize, `Tensor.cpu`, `float`, `bool`,
`item`, and copies, allocations and `torch.tensor` / `torch.full` calls that took longer than
`--least-ms`) and the C library's step call, runs forward + backward of one batch, and prints per
call site (file:line in losshead, and the thread) how often it ran per step and the medians of
when it started, when it ended and how long it waited, in ms from the start of forward; then
the medians of when forward and backward returned and when the step's device work was done.
The wrappers cost some time themselves: compare a build against another with it, and take step
times from bridge_bench.py.

On a GPU the server shares with the trainer, every such wait is for the trainer's own few
kernels behind the server's (BENCHMARKS.md, "The trainer's host waits"):

    python3 client/python/benchmarks/step_waits.py --server 127.0.0.1:50051 --streams 4

`--trunk-gemms N` queues N GEMMs ahead of each step, still running when the head is called, as a
trainer's trunk would be (benchmarks/_trunk.py; its queueing is inside the step's time).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

from _trunk import make_trunk
from losshead import Client, RemoteLMHead

# (step, call site, thread, start s, end s) from the start of the step's forward.
_Record = Tuple[int, str, str, float, float]


class Recorder:
    """The wrapped calls of the timed steps."""

    def __init__(self) -> None:
        self.records: List[_Record] = []
        self.step = -1  # negative: not recording (warm-up)
        self.start = 0.0
        self._lock = threading.Lock()

    def wrap(self, owner: Any, name: str, label: str = "", least: float = 0.0) -> None:
        """Replaces owner.name by a wrapper that records calls lasting at least `least` s."""
        original: Callable[..., Any] = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            out = original(*args, **kwargs)
            end = time.perf_counter()
            if self.step >= 0 and end - begin >= least:
                record = (self.step, label or f"{name} @ {_site()}",
                          threading.current_thread().name[:12], begin - self.start,
                          end - self.start)
                with self._lock:
                    self.records.append(record)
            return out
        setattr(owner, name, wrapper)


def _site() -> str:
    """file:line of the innermost losshead frame that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # not _site nor the wrapper
        if "/losshead/" in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "elsewhere"


def _wrap_blocking_calls(rec: Recorder, least: float) -> None:
    for owner, name in ((torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.Tensor, "cpu"), (torch.Tensor, "__float__"),
                        (torch.Tensor, "__bool__"), (torch.Tensor, "item")):
        rec.wrap(owner, name)
    for name in ("copy_", "to", "pin_memory"):
        rec.wrap(torch.Tensor, name, least=least)
    for name in ("tensor", "full", "empty", "cat"):
        rec.wrap(torch, name, least=least)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--trunk-gemms", type=int, default=0,
                   help="GEMMs (4096 x D by D x D) queued ahead of each step, still running when "
                        "the head is called (benchmarks/_trunk.py)")
    p.add_argument("--least-ms", type=float, default=0.2,
                   help="copies and allocations shorter than this are not listed")
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    trunk = make_trunk(args.trunk_gemms, args.hidden, torch.bfloat16, device)
    rec = Recorder()
    _wrap_blocking_calls(rec, args.least_ms / 1e3)
    head = f"step-waits-{time.time_ns()}"
    steps: List[Tuple[float, float, float]] = []
    with Client(args.server, native=False) as admin:
        admin.create_head(head, args.vocab, args.hidden, weight_dtype=torch.bfloat16,
                          init_std=0.02, seed=1)
        try:
            with Client(args.server, native=True) as c:
                if c.native:
                    rec.wrap(c._natives[0]._lib, "lh_step_many_device", "the C library's step")
                module = RemoteLMHead(c, head, streams=args.streams, wire_dtype=torch.bfloat16)
                for i in range(args.warmup + args.iters):
                    sync()
                    h = hidden.detach().requires_grad_()
                    rec.step = i - args.warmup
                    rec.start = time.perf_counter()
                    trunk()
                    loss = module(h, targets)
                    forward = time.perf_counter() - rec.start
                    loss.backward()
                    backward = time.perf_counter() - rec.start
                    sync()
                    if rec.step >= 0:
                        steps.append((forward, backward, time.perf_counter() - rec.start))
                rec.step = -1
        finally:
            admin.delete_head(head)
    _print(rec.records, steps, args.iters)


def _print(records: List[_Record], steps: List[Tuple[float, float, float]], iters: int) -> None:
    def ms(x: float) -> str:
        return f"{1e3 * x:8.2f}"

    by: Dict[Tuple[str, str], List[Tuple[float, float]]] = collections.defaultdict(list)
    for _, label, thread, begin, end in records:
        by[(label, thread)].append((begin, end))
    print(f"{'call site':<48} {'thread':<12} {'per step':>8} {'starts':>8} {'ends':>8} "
          f"{'waits':>8}   (medians, ms from the start of forward)")
    for (label, thread), calls in sorted(by.items(),
                                         key=lambda kv: statistics.median(b for b, _ in kv[1])):
        print(f"{label:<48} {thread:<12} {len(calls) / iters:8.1f} "
              f"{ms(statistics.median(b for b, _ in calls))} "
              f"{ms(statistics.median(e for _, e in calls))} "
              f"{ms(statistics.median(e - b for b, e in calls))}")
    print(f"forward returned {ms(statistics.median(s[0] for s in steps))}, backward returned "
          f"{ms(statistics.median(s[1] for s in steps))}, the device done "
          f"{ms(statistics.median(s[2] for s in steps))} ms")


if __name__ == "__main__":
    main()
