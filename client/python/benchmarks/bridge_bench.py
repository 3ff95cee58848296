"""The PyTorch bridge against a running losshead server, beside a local head on the same data.

Starts nothing: give it the address of a server (see client/python/README.md for the GPU-host
command line). Measures, per data path (native C++ client, gRPC from Python) and stream count,
RemoteLMHead forward + backward over one batch (median after warm-up; tokens/s and the
trainer's extra device memory), the local head (F.linear + F.cross_entropy, eager and
torch.compile) on the same hidden states and weights, and pull / push / download throughput
from Python. The head is created with W ~ N(0, 0.02^2) and the local head copies it; hidden
states are N(0, 1). Each remote result is checked against the local head before it is timed.

`--dtype` (bfloat16 by default, or float32) is the dtype of the server's head, of the local head
(W and hidden states) and of the hidden states the trainer holds; they travel in it both ways
(RemoteLMHead's wire_dtype: hidden states up, dH down), so bf16 as before, and fp32 for an fp32
head: in bf16 the trainer's fp32 hidden states would lose 16 mantissa bits before the server's
GEMMs, and dH as many on its way back, and the two heads would not compute the same thing.
`--fp32-precision` (float32 only) is the head's matmul_precision on the server and
torch.set_float32_matmul_precision for the local rows, so that both compute at it; the reference
that the remote rows are checked against is computed at "highest".

    python3 client/python/benchmarks/bridge_bench.py --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from _trunk import make_trunk
from losshead import Client, RemoteLMHead, native_available, native_library

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, warmup: int,
                    iters: int, gap: float = 0.0) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        time.sleep(gap)  # the trainer's own work between two head steps (not timed)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _extra_memory_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Peak device memory of one call above what was allocated before it."""
    if device.type != "cuda":
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


Row = Tuple[str, float, float, Optional[float], str]


def _set_fp32_matmul_precision(precision: str) -> None:
    # allow_tf32 first: setting it moves the precision to "high", which would undo "medium".
    torch.backends.cuda.matmul.allow_tf32 = precision != "highest"
    torch.set_float32_matmul_precision(precision)


def _tolerance(dtype: str, precision: str) -> float:
    """The relative error of loss and dH (norm) a remote row may show against the reference."""
    if dtype == "bfloat16":
        return 2e-2
    if precision == "highest":
        # IEEE fp32 products on both sides: only the order of the fp32 sums differs, which moves
        # loss and dH by about 1e-7 to 1e-6 (sqrt(D) roundings of 2^-24 each).
        return 1e-4
    if precision == "high":
        # TF32 keeps 10 of fp32's 23 mantissa bits: each GEMM input is off by at most 2^-10 of
        # itself (truncated; 2^-11 rounded to nearest), each product by 2 x 2^-10, and sums of
        # such products over random-signed data stay within that relative to their size. The
        # loss (log V plus a few) moves far less; dH is mostly W's target row, off by < 2^-10.
        # Emulated at V=128256, D=4096 against float64: dH 3.1e-4 rounded, 6.3e-4 truncated,
        # loss below 1e-4. Four times 2^-10 (3.9e-3) leaves room for both.
        return 4 * 2 ** -10
    # "medium" may round the GEMM inputs to bf16 (7 mantissa bits), as a bf16 head's inputs
    # are (emulated as above: dH 2.6e-3 rounded, 6.9e-3 truncated); its logits stay fp32, so a
    # bf16 head's bound holds.
    return 2e-2


def _fwd_bwd(loss_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
             trunk: Callable[[], object] = lambda: None) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        trunk()  # queued ahead of the head on the trainer's stream, not waited for
        h = hidden.detach().requires_grad_()
        loss = loss_fn(h)
        loss.backward()
        return loss.detach()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="RemoteLMHead's chunk_tokens (default: its own)")
    p.add_argument("--streams", default="1,4", help="comma-separated stream counts")
    p.add_argument("--connections", type=int, default=None,
                   help="cap on the Client's connections for the RemoteLMHead rows (default: "
                        "none, one per stream)")
    p.add_argument("--paths", default="native",
                   help="comma-separated: native (C++ client), grpc (Python only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="the head's weight dtype on the server and the local head's (W and hidden "
                        "states); also the wire dtype of hidden states and dH")
    p.add_argument("--fp32-precision", choices=["highest", "high", "medium"], default="highest",
                   help="float32 only: the server head's matmul_precision and "
                        "torch.set_float32_matmul_precision for the local rows")
    # A new client's first steps find no recycled result buffers on the server (they come back
    # as its idempotency window fills, about four steps of 8192 x 4096 bf16): not the steady state.
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="untimed pause before each timed step, standing for the trunk's forward "
                        "and backward between two head steps")
    p.add_argument("--trunk-gemms", type=int, default=0,
                   help="GEMMs (4096 x D by D x D) queued on the trainer's stream ahead of each "
                        "timed step and timed with it, standing for the trunk's last layers, "
                        "still running when the head is called; a row of them alone is printed")
    p.add_argument("--no-local", action="store_true", help="skip the local-head rows")
    p.add_argument("--no-transfers", action="store_true", help="skip pull / push / download")
    p.add_argument("--no-steps", action="store_true",
                   help="skip the RemoteLMHead rows (transfers only)")
    p.add_argument("--plans", default="",
                   help="extra native rows, comma-separated STREAMS:CHUNK:MIN:DEPTH:EDGE (the "
                        "RemoteLMHead cut: streams, chunk_tokens, min_chunk_tokens, depth, "
                        "edge_tokens)")
    p.add_argument("--token", default=os.environ.get("LOSSHEAD_TOKEN"))
    args = p.parse_args()
    fp32 = args.dtype == "float32"
    if not fp32 and args.fp32_precision != "highest":
        p.error("--fp32-precision applies to --dtype float32 only, as the server's "
                "matmul_precision does")
    if fp32:
        _set_fp32_matmul_precision("highest")  # for the reference; the local rows set their own

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    v, d, n = args.vocab, args.hidden, args.tokens
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    head = f"bridge-bench-{os.getpid()}"
    # A bf16 head has no precision to choose: its line reads as it always has.
    precision = f" matmul_precision={args.fp32_precision}" if fp32 else ""
    print(f"native library: {native_library() if native_available() else 'absent'}")
    print(f"V={v} D={d} tokens/step={n} {_SHORT[dtype]}{precision} device={device}")

    rows: List[Row] = []
    args.trunk = _trunk(args.trunk_gemms, d, dtype, device, args, rows)
    with Client(args.server, token=args.token, native=False) as admin:
        admin.create_head(head, v, d, weight_dtype=dtype, init_std=0.02, seed=1,
                          matmul_precision=args.fp32_precision if fp32 else None)
        try:
            if not args.no_steps:
                weight = admin.download_weights(head).weights.to(device)
                # The reference every remote row must match before it is timed: loss and dH.
                h = hidden.detach().requires_grad_()
                local = F.cross_entropy(F.linear(h, weight).float(), targets)
                local.backward()
                ref = (float(local.detach()), h.grad)
                del h, local
                for path in args.paths.split(","):
                    for streams in (int(s) for s in args.streams.split(",") if s):
                        rows.append(_remote_row(args, path, streams, head, hidden, targets,
                                                device, ref, n))
                        admin.pull_gradient(head, reset=True)  # keep dW bounded between rows
                for plan in filter(None, args.plans.split(",")):
                    streams, chunk, floor, depth, edge = (int(x) for x in plan.split(":"))
                    rows.append(_remote_row(args, "native", streams, head, hidden, targets,
                                            device, ref, n, chunk_tokens=chunk,
                                            min_chunk_tokens=floor, depth=depth,
                                            edge_tokens=edge))
                    admin.pull_gradient(head, reset=True)
                if not args.no_local:
                    if fp32:
                        _set_fp32_matmul_precision(args.fp32_precision)
                    rows += _local_rows(args, hidden, targets, weight, device, n)
            transfers = [] if args.no_transfers else [
                _transfer_rows(args, path, head, v, d) for path in args.paths.split(",")]
        finally:
            admin.delete_head(head)

    print(f"\n{'path':<44} {'ms/step':>9} {'tokens/s':>10} {'extra MiB':>10}  note")
    for name, ms, tps, mib, note in rows:
        mem = f"{mib:10.0f}" if mib is not None else f"{'-':>10}"
        print(f"{name:<44} {ms:9.1f} {tps:10,.0f} {mem}  {note}")
    for t in transfers:
        for name, gbps, note in t:
            print(f"{name:<44} {gbps:9.2f} GB/s  {note}")


def _trunk(count: int, d: int, dtype: torch.dtype, device: torch.device,
           args: argparse.Namespace, rows: List[Row]) -> Callable[[], object]:
    """The trunk of `count` GEMMs (benchmarks/_trunk.py); its own row goes into `rows`."""
    trunk = make_trunk(count, d, dtype, device)
    if count > 0:
        seconds = _median_seconds(trunk, device, args.warmup, args.iters)
        rows.append((f"trunk alone ({count} GEMMs)", seconds * 1e3, 0.0, None,
                     "queued ahead of every row's step and timed with it"))
    return trunk


def _remote_row(args: argparse.Namespace, path: str, streams: int, head: str,
                hidden: torch.Tensor, targets: torch.Tensor, device: torch.device,
                ref: Tuple[float, torch.Tensor], n: int, **cut: int) -> Row:
    with Client(args.server, token=args.token, native=path == "native",
                connections=args.connections) as c:
        if args.chunk_tokens is not None:
            cut.setdefault("chunk_tokens", args.chunk_tokens)
        module = RemoteLMHead(c, head, streams=streams, wire_dtype=hidden.dtype, **cut)
        local_loss, local_grad = ref
        h = hidden.detach().requires_grad_()
        out = module(h, targets)
        out.backward()
        loss = float(out.detach())
        # The remote head must compute what the local one does before it is timed.
        tol = _tolerance(args.dtype, args.fp32_precision)
        assert abs(loss - local_loss) <= tol * abs(local_loss), (loss, local_loss, tol)
        err = float((h.grad.float() - local_grad.float()).norm() / local_grad.float().norm())
        assert err <= tol, f"dH differs from the local head's by {err:.3g} (relative norm)"
        del h
        run = _fwd_bwd(lambda h: module(h, targets), hidden, args.trunk)
        seconds = _median_seconds(run, device, args.warmup, args.iters, args.gap_ms / 1e3)
        mib = _extra_memory_mib(run, device)
    sizes = module._chunks_for(n)
    connections = min(streams, args.connections or streams)
    return (f"RemoteLMHead {path}, {streams} stream(s), {connections} conn.", seconds * 1e3,
            n / seconds, mib,
            f"loss {loss:.4f} (local {local_loss:.4f}), dH rel. err {err:.1e}; "
            f"micro-batches {sizes}")


def _local_rows(args: argparse.Namespace, hidden: torch.Tensor, targets: torch.Tensor,
                weight: torch.Tensor, device: torch.device, n: int) -> List[Row]:
    w = weight.detach().clone().requires_grad_()

    def loss_fn(h: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), targets)

    rows = []
    variants = [("local head, eager", loss_fn)]
    if hasattr(torch, "compile"):
        variants.append(("local head, torch.compile", torch.compile(loss_fn)))
    for name, fn in variants:
        run = _fwd_bwd(fn, hidden, args.trunk)
        seconds = _median_seconds(run, device, args.warmup, args.iters, args.gap_ms / 1e3)
        w.grad = None
        mib = _extra_memory_mib(run, device)
        rows.append((name, seconds * 1e3, n / seconds, mib, "+ W and dW resident"))
        w.grad = None
    return rows


def _transfer_rows(args: argparse.Namespace, path: str, head: str, v: int, d: int
                   ) -> List[Tuple[str, float, str]]:
    cpu = torch.device("cpu")
    with Client(args.server, token=args.token, native=path == "native") as c:
        w = c.download_weights(head).weights
        fp32 = v * d * 4
        pull = _median_seconds(lambda: c.pull_gradient(head), cpu, 1, args.iters)
        # Into a tensor allocated once, as RemoteHeadOptimizer pulls: no page faults per call.
        g = torch.empty(v, d, dtype=torch.float32)
        pull_into = _median_seconds(lambda: c.pull_gradient(head, out=g), cpu, 1, args.iters)
        push = _median_seconds(lambda: c.push_weights(head, w), cpu, 1, args.iters)
        down = _median_seconds(lambda: c.download_weights(head), cpu, 1, args.iters)
        w2 = torch.empty_like(w)
        down_into = _median_seconds(lambda: c.download_weights(head, out=w2), cpu, 1, args.iters)
    # W travels in the head's dtype (download_weights' and push_weights' default).
    size, wt = w.numel() * w.element_size(), _SHORT[w.dtype]
    return [(f"pull dW fp32 ({path})", fp32 / pull / 1e9, f"{fp32 / 2**20:.0f} MiB, fresh tensor"),
            (f"pull dW fp32 ({path})", fp32 / pull_into / 1e9,
             f"{fp32 / 2**20:.0f} MiB, into a reused tensor"),
            (f"push W {wt} ({path})", size / push / 1e9, f"{size / 2**20:.0f} MiB"),
            (f"download W {wt} ({path})", size / down / 1e9,
             f"{size / 2**20:.0f} MiB, fresh tensor"),
            (f"download W {wt} ({path})", size / down_into / 1e9,
             f"{size / 2**20:.0f} MiB, into a reused tensor")]


if __name__ == "__main__":
    main()
