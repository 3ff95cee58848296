#!/usr/bin/env python3
"""PyTorch baselines for losshead_kernel_bench: eager and torch.compile of
logits = h @ w.T; loss = cross_entropy(logits.float(), y); loss.backward(), bf16 inputs.

Times forward + backward with CUDA events (warm-up, median of --runs) on random data, and the peak
device memory the step allocates beyond its inputs and parameter gradients.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

SHAPES = [(4096, 128256, 4096), (8192, 128256, 4096), (16384, 128256, 4096),
          (8192, 256000, 2304), (8192, 128256, 8192), (8192, 50257, 4096)]


def step(h, w, y):
    logits = h @ w.t()
    return F.cross_entropy(logits.float(), y)


def median_ms(fn, runs, warmup=3):
    """Median time of fn() in ms over `runs` calls, CUDA events around each, after a warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench(fn, h, w, y, runs):
    def once():
        h.grad = None
        w.grad = None
        fn(h, w, y).backward()

    ms = median_ms(once, runs)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    once()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return ms, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    compiled = None if args.no_compile else torch.compile(step, dynamic=False)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("|     N |      V |    D | eager ms | eager extra MiB | compile ms | compile extra MiB |")
    for n, v, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.rand(n, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
        w = ((torch.rand(v, d, device="cuda", generator=g) * 2 - 1) * (4 / d ** 0.5)).bfloat16()
        w.requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        e_ms, e_mem = bench(step, h, w, y, args.runs)
        if compiled is not None:
            c_ms, c_mem = bench(compiled, h, w, y, args.runs)
        else:
            c_ms, c_mem = float("nan"), 0
        print(f"| {n:5d} | {v:6d} | {d:4d} | {e_ms:8.2f} | {e_mem / 2**20:15.0f} | {c_ms:10.2f} "
              f"| {c_mem / 2**20:17.0f} |", flush=True)
        del h, w, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
