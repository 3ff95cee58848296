"""Where a RemoteLMHead step's time goes: its cut, the Python side and the server's phases.

Starts nothing: give it a running server and its metrics address. For each cut of one batch
(streams, chunk_tokens, min_chunk_tokens, depth, edge_tokens), it times forward + backward
(median), the part spent in the step streams, and, from the server's
`losshead_step_phase_duration_seconds` histograms scraped before and after the timed steps, each
phase summed over the step's micro-batches: receive, queue, stage, compute, finish, send. `compute`
is the time the device spent on the step; what the step took beyond it is pipeline fill and drain
(nothing computes before the first micro-batch has arrived; nothing returns before the last one's
dH has been sent) and Python.

With `--trace`, the server's `--step_trace` file (the server on this host, so that both clocks
are the same), it also prints each cut's timeline: when, from the start of forward, the first
micro-batch had arrived whole, the device started, the device finished, the last answer was
written and backward returned, and how long the device sat idle in between (medians over the
timed steps).

    python3 client/python/benchmarks/step_phases.py --server 127.0.0.1:50051 \\
        --metrics 127.0.0.1:9100 --plans 4:2048:1024:4:512,4:1024:1024:2:0 \\
        [--trace /tmp/step-trace.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import urllib.request
from typing import Dict, List, Tuple

import torch

import losshead._steps as steps
from losshead import Client, RemoteLMHead

_PHASE = re.compile(
    r'losshead_step_phase_duration_seconds_(sum|count)\{head="([^"]*)",phase="(\w+)"\} (\S+)')


def scrape(metrics: str, head: str) -> Dict[Tuple[str, str], float]:
    """(phase, "sum" | "count") -> value, for `head`."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        m = _PHASE.match(line)
        if m and m.group(2) == head:
            out[(m.group(3), m.group(1))] = float(m.group(4))
    return out


def timeline(trace: str, head: str, steps: List[Tuple[int, int]]) -> str:
    """Medians over `steps` ((start, end) in Unix microseconds) of their micro-batches' phases."""
    with open(trace) as f:
        records = [r for r in map(json.loads, f) if r["head"] == head and r["compute_us"]]
    rows: Dict[str, List[float]] = {}
    for start, end in steps:
        mine = [r for r in records if start <= r["first_message_us"] <= end]
        if not mine:
            continue
        busy = sum(r["compute_end_us"] - r["compute_us"] for r in mine)
        first = min(r["compute_us"] for r in mine)
        last = max(r["compute_end_us"] for r in mine)
        marks = {"first arrived": min(r["last_message_us"] for r in mine),
                 "device starts": first, "device ends": last,
                 "last answer written": max(r["sent_us"] for r in mine), "step ends": end}
        for name, t in marks.items():
            rows.setdefault(name, []).append((t - start) / 1e3)
        rows.setdefault("device idle between", []).append((last - first - busy) / 1e3)
    return "; ".join(f"{k} {statistics.median(v):.1f}" for k, v in rows.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--metrics", required=True, help="the server's --metrics_listen address")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--plans", default="4:2048:1024:4:512,1:2048:1024:4:512",
                   help="comma-separated STREAMS:CHUNK:MIN:DEPTH:EDGE (RemoteLMHead's cut)")
    p.add_argument("--trace", help="the server's --step_trace file: print each cut's timeline")
    # Past the first steps of a new client: until its idempotency window is full, the server
    # allocates fresh result buffers (page faults), later it recycles them.
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # The time inside the step streams (run_microbatches), apart from Python's own work.
    inside: List[float] = []
    run = steps.Steps.run_microbatches

    def timed_run(self, *a, **k):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return run(self, *a, **k)
        finally:
            inside.append(time.perf_counter() - start)
    steps.Steps.run_microbatches = timed_run  # type: ignore[method-assign]

    v, d, n = args.vocab, args.hidden, args.tokens
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    head = f"step-phases-{os.getpid()}"
    with Client(args.server, native=False) as admin:
        admin.create_head(head, v, d, weight_dtype=torch.bfloat16, init_std=0.02, seed=1)
        try:
            for plan in filter(None, args.plans.split(",")):
                streams, chunk, floor, depth, edge = (int(x) for x in plan.split(":"))
                with Client(args.server, native=True, connections=streams) as c:
                    module = RemoteLMHead(c, head, streams=streams, chunk_tokens=chunk,
                                          min_chunk_tokens=floor, depth=depth, edge_tokens=edge)

                    spans: List[Tuple[int, int]] = []  # wall clock, as the trace's

                    def step() -> float:
                        h = hidden.detach().requires_grad_()
                        sync()
                        wall = time.time_ns() // 1000
                        start = time.perf_counter()
                        module(h, targets).backward()
                        sync()
                        spans.append((wall, time.time_ns() // 1000))
                        return time.perf_counter() - start

                    for _ in range(args.warmup):
                        step()
                    admin.pull_gradient(head, reset=True)
                    inside.clear()
                    spans.clear()
                    before = scrape(args.metrics, head)
                    times = [step() for _ in range(args.iters)]
                    after = scrape(args.metrics, head)
                    admin.pull_gradient(head, reset=True)
                per_step = {phase: (after[(phase, "sum")] - before.get((phase, "sum"), 0.0))
                            / args.iters * 1e3
                            for phase, kind in after if kind == "sum"}
                ms = statistics.median(times) * 1e3
                print(f"{plan:<20} {module._chunks_for(n)}\n"
                      f"  step {ms:.1f} ms ({n / ms * 1e3:,.0f} tokens/s), in the streams "
                      f"{statistics.median(inside) * 1e3:.1f} ms; server, summed over the step's "
                      f"micro-batches: "
                      + ", ".join(f"{k} {per_step[k]:.1f}" for k in sorted(per_step)), flush=True)
                if args.trace:
                    print(f"  timeline, ms from the start of forward: "
                          f"{timeline(args.trace, head, spans)}", flush=True)
        finally:
            admin.delete_head(head)


if __name__ == "__main__":
    main()
