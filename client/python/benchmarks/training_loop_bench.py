"""A training loop's head, seen from the trainer: the server's optimizer against the mirror path.

Starts nothing: give it the address of a running server. Creates a bf16 head drawn from
N(0, 0.02^2) and runs `--steps` optimizer steps (after one warm-up step), each over
`--tokens-per-step` tokens sent as RemoteLMHead forward + backward calls of `--microbatch`
tokens, then the head's optimizer step:
  - server: RemoteAdamW.step() (W, dW, master weights and AdamW state stay on the server);
  - mirror: RemoteHeadOptimizer.step(torch.optim.AdamW) with the fp32 copy of W and the AdamW
    state on the trainer's device (pull dW, step, push W).
Reports tokens/s over the timed steps (optimizer steps included), the bytes each step moves
over the wire (from the tensors' sizes: hidden states up and dH down, plus dW down and W up for
the mirror), and the trainer's peak GPU memory (torch.cuda.max_memory_allocated) and peak host
memory (the process's maximum resident set). Run one path per process, so that the host peak is
that path's own:

    python3 client/python/benchmarks/training_loop_bench.py --server 127.0.0.1:50051 --path server
    python3 client/python/benchmarks/training_loop_bench.py --server 127.0.0.1:50051 --path mirror
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from losshead import Client, RemoteAdamW, RemoteHeadOptimizer, RemoteLMHead


def _rss_gib() -> float:
    """The process's peak resident set so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--path", choices=["server", "mirror"], required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--microbatch", type=int, default=8192, help="tokens per forward + backward")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    v, d, n = args.vocab, args.hidden, args.microbatch
    calls = max(1, args.tokens_per_step // n)

    client = Client(args.server, connections=args.streams)
    head = f"training-loop-{args.path}-{os.getpid()}"
    client.create_head(head, v, d, weight_dtype=torch.bfloat16, init_std=0.02, seed=1)
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        hidden = torch.randn(n, d, generator=gen).to(device, torch.bfloat16)
        targets = torch.randint(0, v, (n,), generator=gen).to(device)
        module = RemoteLMHead(client, head, streams=args.streams)
        if args.path == "server":
            opt = RemoteAdamW(client, head, lr=1e-4, weight_decay=0.1)
            step = opt.step
        else:
            mirror = RemoteHeadOptimizer(client, head, device=device)
            fused = {"fused": True} if device.type == "cuda" else {}  # the fastest torch has
            local = torch.optim.AdamW([mirror.weight], lr=1e-4, weight_decay=0.1, **fused)

            def step() -> None:
                mirror.step(local)

        def train_step() -> None:
            for _ in range(calls):
                h = hidden.detach().requires_grad_()
                module(h, targets).backward()
            step()

        train_step()  # warm-up: connections, caches, the optimizer's state
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        gpu = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0
    finally:
        client.delete_head(head)

    tokens = args.steps * calls * n
    steps_bytes = calls * n * (2 * d * 2 + 8)  # bf16 hidden up, bf16 dH down, int64 targets
    mirror_bytes = v * d * (4 + 2) if args.path == "mirror" else 0  # fp32 dW down, bf16 W up
    print(f"V={v} D={d} {calls} x {n} tokens per optimizer step, {args.streams} streams, "
          f"device {device}, {args.steps} timed steps")
    print(f"{args.path}: {tokens / seconds:,.0f} tokens/s, {seconds / args.steps * 1e3:.0f} ms "
          f"per optimizer step; wire per step {(steps_bytes + mirror_bytes) / 1e9:.2f} GB "
          f"(steps {steps_bytes / 1e9:.2f} + optimizer {mirror_bytes / 1e9:.2f}); trainer peak "
          f"GPU {gpu:.2f} GiB, peak host RSS {_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
