"""What the whole-batch check of a cut batch costs a RemoteLMHead step.

`step_chunked` (and so RemoteLMHead) checks a batch cut into several micro-batches for what the
server would refuse in one of them (losshead._batch_check): for a CUDA tensor, one reduction on
the tensor's device queued ahead of the copies to pinned memory. This times forward + backward
with the check and with the check taken out (the staging asked for no measurement), alternating
step by step in one process so that both see the same host, server and GPU state, and prints the
medians of each round.

Starts nothing: give it a running server. Put the server on another GPU than `--device` (say
CUDA_VISIBLE_DEVICES=1 for the server and --device cuda:0 here) to measure the deployed case, or
on the same one to measure a shared GPU.

    python3 client/python/benchmarks/batch_check_cost.py --server 127.0.0.1:50051 \\
        --device cuda:0 --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

import losshead._steps as steps
from losshead import Client, RemoteLMHead

_checked_staging = steps._staged


def _unchecked_staging(*args, **kwargs):  # type: ignore[no-untyped-def]
    kwargs["measure"] = False
    return _checked_staging(*args, **kwargs)


def _timed_step(module: RemoteLMHead, hidden: torch.Tensor, targets: torch.Tensor,
                device: torch.device, check: bool) -> float:
    steps._staged = _checked_staging if check else _unchecked_staging
    try:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        h = hidden.detach().requires_grad_()
        module(h, targets).backward()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    finally:
        steps._staged = _checked_staging


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=60, help="timed steps per round, both modes")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    device = torch.device(args.device)
    v, d, n = args.vocab, args.hidden, args.tokens
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    head = f"batch-check-cost-{os.getpid()}"
    print(f"V={v} D={d} tokens/step={n} bf16, {args.streams} streams, tensors on {device} "
          f"({torch.cuda.get_device_name(device)})")
    with Client(args.server) as client:
        client.create_head(head, v, d, weight_dtype=torch.bfloat16, init_std=0.02, seed=1)
        try:
            module = RemoteLMHead(client, head, streams=args.streams)
            for i in range(args.warmup):
                _timed_step(module, hidden, targets, device, check=i % 2 == 0)
            for r in range(args.rounds):
                times: Dict[bool, List[float]] = {True: [], False: []}
                for i in range(args.steps):
                    check = (i + r) % 2 == 0
                    times[check].append(_timed_step(module, hidden, targets, device, check))
                client.pull_gradient(head, reset=True)  # keep dW bounded between rounds
                on = statistics.median(times[True]) * 1e3
                off = statistics.median(times[False]) * 1e3
                print(f"round {r + 1}: with the check {on:.2f} ms, without {off:.2f} ms, "
                      f"difference {on - off:+.2f} ms ({(on - off) / off * 100:+.1f} %)")
        finally:
            client.delete_head(head)


if __name__ == "__main__":
    main()
