#!/usr/bin/env python3
"""PyTorch baselines for losshead_kernel_bench: eager and torch.compile of
logits = h @ w.T; loss = cross_entropy(logits.float(), y); loss.backward(), bf16 inputs by default
(--dtype float32 for fp32 ones, at --fp32-precision).

Times forward + backward with CUDA events (warm-up, median of --runs) on random data, and the peak
device memory the step allocates beyond its inputs and parameter gradients. Then the same three
GEMMs alone (logits = h @ w.T, dH = g @ w, dW = g.T @ h, g random of the logits' shape and dtype),
each the median of --runs: what the step costs with nothing but its matrix products, as the
kernel bench's SOL column is for the fused call.

--fp32-precision sets torch.set_float32_matmul_precision. On CUDA, torch runs an fp32 matmul in
TF32 at both "high" and "medium", so "medium" times what "high" does; so does
losshead_kernel_bench --precision=medium, whose cuBLAS compute type permits bf16 but whose
kernels are those of high on an H100.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

SHAPES = [(4096, 128256, 4096), (8192, 128256, 4096), (16384, 128256, 4096),
          (8192, 256000, 2304), (8192, 128256, 8192), (8192, 50257, 4096)]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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


def bench_matmuls(h, w, runs):
    """Median ms of each of the step's three GEMMs alone, into preallocated outputs."""
    h, w = h.detach(), w.detach()
    n, v = h.shape[0], w.shape[0]
    g = torch.rand(n, v, device="cuda", dtype=h.dtype) * 2 - 1
    logits, dh, dw = torch.empty_like(g), torch.empty_like(h), torch.empty_like(w)
    with torch.no_grad():
        times = (median_ms(lambda: torch.mm(h, w.t(), out=logits), runs),
                 median_ms(lambda: torch.mm(g, w, out=dh), runs),
                 median_ms(lambda: torch.mm(g.t(), h, out=dw), runs))
    del g, logits, dh, dw
    return times


def parse_shapes(text):
    """N:V:D,N:V:D as a list of (n, v, d)."""
    try:
        shapes = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected N:V:D[,N:V:D...], got {text!r}")
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="dtype of h and w (and so of the logits' GEMM and the gradients)")
    ap.add_argument("--fp32-precision", choices=["highest", "high", "medium"], default="highest",
                    help="torch.set_float32_matmul_precision; float32 only")
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES, metavar="N:V:D,...",
                    help="shapes instead of the default list")
    args = ap.parse_args()
    if args.dtype != "float32" and args.fp32_precision != "highest":
        ap.error("--fp32-precision applies to --dtype float32 only, as the server's"
                 " matmul_precision does")
    # allow_tf32 first: setting it moves the precision to "high", which would undo "medium".
    torch.backends.cuda.matmul.allow_tf32 = args.fp32_precision != "highest"
    torch.set_float32_matmul_precision(args.fp32_precision)
    dtype = DTYPES[args.dtype]
    compiled = None if args.no_compile else torch.compile(step, dynamic=False)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}, "
          f"float32 matmul precision {torch.get_float32_matmul_precision()}")
    print("|     N |      V |    D | eager ms | eager extra MiB | compile ms | compile extra MiB "
          "| matmuls ms (logits+dH+dW) |")
    for n, v, d in args.shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.rand(n, d, device="cuda", generator=g) * 2 - 1).to(dtype).requires_grad_()
        w = ((torch.rand(v, d, device="cuda", generator=g) * 2 - 1) * (4 / d ** 0.5)).to(dtype)
        w.requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        e_ms, e_mem = bench(step, h, w, y, args.runs)
        if compiled is not None:
            c_ms, c_mem = bench(compiled, h, w, y, args.runs)
        else:
            c_ms, c_mem = float("nan"), 0
        h.grad = None
        w.grad = None
        mm = bench_matmuls(h, w, args.runs)
        print(f"| {n:5d} | {v:6d} | {d:4d} | {e_ms:8.2f} | {e_mem / 2**20:15.0f} | {c_ms:10.2f} "
              f"| {c_mem / 2**20:17.0f} | {sum(mm):8.2f} ({mm[0]:.2f}+{mm[1]:.2f}+{mm[2]:.2f}) |",
              flush=True)
        del h, w, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
