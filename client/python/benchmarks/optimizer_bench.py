"""One optimizer step of a head, seen from the trainer: server-side AdamW against the mirror path.

Starts nothing: give it the address of a running server. Creates a bf16 head drawn from
N(0, 0.02^2) with a server-side AdamW, fills its gradient window with one RemoteLMHead forward +
backward, and times from Python (wall clock, median after a warm-up):
  - RemoteAdamW.step() (the ApplyOptimizer round trip: window cut, norm, step, version bump),
    with and without global-norm clipping, and the trainer's GPU memory for the head (none);
  - the mirror path on the same head (RemoteHeadOptimizer: pull dW, torch AdamW on a local fp32
    copy of W, push W), once, and the memory it holds on the trainer.
Each apply re-fills the window first (outside the timed region), so every step has a gradient.

    python3 client/python/benchmarks/optimizer_bench.py --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from losshead import Client, RemoteAdamW, RemoteHeadOptimizer, RemoteLMHead


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per window fill")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--mirror", action="store_true", help="also time the mirror path once")
    p.add_argument("--replicas", type=int, default=1,
                   help="server devices the head is replicated over (0: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    client = Client(args.server)
    head_name = f"optimizer-bench-{int(time.time())}"
    client.create_head(head_name, args.vocab, args.hidden, weight_dtype=torch.bfloat16,
                       init_std=0.02, seed=1, replicas=args.replicas)
    try:
        head = RemoteLMHead(client, head_name)
        opt = RemoteAdamW(client, head_name, lr=1e-4, weight_decay=0.1)
        gen = torch.Generator(device="cpu").manual_seed(0)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
        targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)

        def fill() -> None:
            h = hidden.clone().requires_grad_(True)
            head(h, targets).backward()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        rows = []
        for label, kwargs in (("RemoteAdamW.step()", {}),
                              ("RemoteAdamW.step(max_norm=1.0)", {"max_norm": 1.0,
                                                                   "trunk_grad_sq_norm": 4.0})):
            times = []
            for i in range(args.iters + 2):
                fill()
                start = time.perf_counter()
                opt.step(**kwargs)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            r = opt.last_result
            rows.append((label, statistics.median(times) * 1e3,
                         f"tokens {r.token_count}, head norm {r.head_grad_norm:.4f}, "
                         f"clip {r.clip_coefficient:.4f}, version {r.weights_version}"))
        held = ((torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
                if device.type == "cuda" else float("nan"))
        print(f"V={args.vocab} D={args.hidden} bf16 head, AdamW, window of {args.tokens} tokens, "
              f"median of {args.iters}; trainer peak extra GPU memory over the run "
              f"(forward/backward buffers included): {held:.0f} MiB")
        for label, ms, note in rows:
            print(f"{label:34s} {ms:9.1f} ms   {note}")
        info = client.get_head(head_name)
        for name, m in zip(info.devices, info.device_memory):
            total = (m.weights_bytes + m.gradient_bytes + m.workspace_bytes
                     + m.master_weights_bytes + m.optimizer_state_bytes)
            print(f"  {name}: W {m.weights_bytes / 2 ** 30:.2f} GiB, dW "
                  f"{m.gradient_bytes / 2 ** 30:.2f}, master {m.master_weights_bytes / 2 ** 30:.2f}, "
                  f"state {m.optimizer_state_bytes / 2 ** 30:.2f}, workspace "
                  f"{m.workspace_bytes / 2 ** 30:.2f}: {total / 2 ** 30:.2f} GiB")

        if args.mirror:
            client.set_optimizer(head_name, "none")
            mirror = RemoteHeadOptimizer(client, head_name, device=device)
            fused = {"fused": True} if device.type == "cuda" else {}
            local = torch.optim.AdamW([mirror.weight], lr=1e-4, weight_decay=0.1, **fused)
            fill()
            start = time.perf_counter()
            mirror.step(local)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ms = (time.perf_counter() - start) * 1e3
            state = sum(t.numel() * t.element_size() for s in local.state.values()
                        for t in s.values() if torch.is_tensor(t))
            print(f"{'mirror: pull, torch AdamW, push':34s} {ms:9.1f} ms   trainer holds fp32 W + "
                  f"state: {(mirror.weight.numel() * 4 + state) / 2 ** 30:.2f} GiB")
    finally:
        client.delete_head(head_name)


if __name__ == "__main__":
    main()
