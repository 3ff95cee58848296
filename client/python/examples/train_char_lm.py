#!/usr/bin/env python3
"""Train a small byte-level transformer whose LM head lives on a losshead server.

The text is an English document from an installed package (the GPL-3 licence by default), read
as bytes (vocabulary 256). The trunk (embeddings, a few pre-norm transformer layers, the final
norm) trains locally with AdamW; the head W (256 x d_model) lives on the server, which returns
loss and dH per micro-batch, accumulates dW and, by default, runs the head's AdamW itself
(`RemoteAdamW`): the trainer holds nothing of the head. Both optimizers follow one learning-rate
schedule (linear warm-up, then cosine decay: torch.optim.lr_scheduler.LambdaLR) and are clipped
together by the global gradient norm over trunk and head (`step_with_clipping`).
With --client-optimizer the head's optimizer runs here instead, on `RemoteHeadOptimizer`'s fp32
mirror of W (pull dW, clip, step, push W every step): the path for optimizers the server lacks.

    python3 train_char_lm.py --server 127.0.0.1:50051 --steps 200 --compare-local

With --compare-local the same model is trained again from the same seed on the same batches
with a local torch head (nn.Linear + F.cross_entropy, the same AdamW, schedule and clipping),
and the largest and mean differences between the two loss curves are reported: they stay at the
level of bf16 rounding (the head's weights, hidden states and dH travel in bf16). At the end the
memory each run held for the head on the trainer is printed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from char_lm_heads import LocalHead, Memory, MirrorHead, ServerOptimizerHead, mirror_memory
from losshead import Client, LossheadError

TEXT_CANDIDATES = [
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/GPL-2",
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/LGPL-3",
    "/usr/share/common-licenses/MPL-2.0",
    "/usr/share/common-licenses/Artistic",
    "/usr/share/dict/words",
    "/usr/share/doc/python3/copyright",
]


def find_text(explicit: Optional[str]) -> Path:
    """The training text: --text, else the first sizeable candidate that exists."""
    if explicit:
        return Path(explicit)
    for candidate in TEXT_CANDIDATES:
        path = Path(candidate)
        if path.is_file() and path.stat().st_size > 10_000:
            return path
    # Any large plain-text copyright file from the installed packages will do.
    for path in sorted(Path("/usr/share/doc").glob("*/copyright")):
        if path.stat().st_size > 20_000:
            return path
    raise SystemExit("no training text found; pass --text FILE")


class CharTransformer(nn.Module):
    """Byte embeddings + learned positions + pre-norm causal transformer layers + final norm.

    Returns hidden states (B, T, d_model); the LM head is separate (local or remote).
    """

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int,
                 vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.layers(x, mask=self.mask[:t, :t])
        return self.norm(x)


def make_batches(data: torch.Tensor, steps: int, accum: int, batch: int, seq_len: int,
                 seed: int) -> List[List[torch.Tensor]]:
    """steps x accum micro-batches of (batch, seq_len + 1) byte windows, fixed by the seed."""
    g = torch.Generator().manual_seed(seed + 1)
    offsets = torch.arange(seq_len + 1)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
            micro.append(data[starts[:, None] + offsets].long())
        out.append(micro)
    return out


def initial_head_weight(d_model: int, seed: int, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randn(vocab, d_model, generator=g) * 0.02


def warmup_cosine(steps: int, warmup: int, min_ratio: float):
    """The learning-rate factor at each scheduler step: linear warm-up to 1 over `warmup` steps,
    then cosine decay to `min_ratio` at the last step."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(batches: Sequence[Sequence[torch.Tensor]], args: argparse.Namespace,
          make_head: Callable[[], Any], label: str) -> Tuple[List[float], Memory]:
    """The training loop shared by every head; returns the loss per step and the head's memory
    on the trainer."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = CharTransformer(args.d_model, args.layers, args.heads, args.seq_len).to(device)
    trunk = list(model.parameters())
    opt = torch.optim.AdamW(trunk, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    head = make_head()
    factor = warmup_cosine(len(batches), args.warmup, args.min_lr_ratio)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (opt, head.optimizer)]
    losses: List[float] = []
    tokens_per_step = args.accum * args.batch * args.seq_len
    window_t0, window_tokens = time.perf_counter(), 0
    for step, micro in enumerate(batches, 1):
        step_loss = 0.0
        for tokens in micro:
            tokens = tokens.to(device)
            hidden = model(tokens[:, :-1])
            # Every micro-batch holds the same number of tokens (none ignored), so the mean of
            # per-micro-batch means is the token mean the head's gradient is normalised to.
            loss = head.loss(hidden, tokens[:, 1:]) / len(micro)
            loss.backward()
            step_loss += float(loss.detach())
        lr = schedules[0].get_last_lr()[0]
        grad_norm = head.step(trunk, args.clip)  # clips the trunk's gradients too
        opt.step()
        opt.zero_grad(set_to_none=True)
        for schedule in schedules:
            schedule.step()
        losses.append(step_loss)
        window_tokens += tokens_per_step
        if step % args.log_every == 0 or step == len(batches):
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_t0
            print(f"[{label}] step {step:5d}  loss {step_loss:.4f}  "
                  f"bits/byte {step_loss / math.log(2):.3f}  lr {lr:.2e}  "
                  f"grad norm {grad_norm:.3f}  {window_tokens / elapsed:,.0f} tokens/s",
                  flush=True)
            window_t0, window_tokens = time.perf_counter(), 0
    return losses, head.memory()


def train_remote(batches, args: argparse.Namespace) -> Tuple[List[float], Memory]:
    client = Client(args.server, connections=args.connections or None)
    client.wait_until_serving(timeout=30)
    name = args.head_name or f"charlm-{os.getpid()}"
    try:
        client.delete_head(name)
    except LossheadError:
        pass
    client.create_head(name, 256, args.d_model, weight_dtype=args.head_dtype)
    client.upload_weights(name, initial_head_weight(args.d_model, args.seed))
    info = client.get_head(name)
    kind = MirrorHead if args.client_optimizer else ServerOptimizerHead
    print(f"remote head {name!r} on {args.server}: {info.spec.vocab_size} x "
          f"{info.spec.hidden_size}, device {info.device}; {kind.label}", flush=True)
    try:
        return train(batches, args, lambda: kind(client, name, args), "remote")
    finally:
        if not args.keep_head:
            client.delete_head(name)
        client.close()


def train_local(batches, args: argparse.Namespace) -> Tuple[List[float], Memory]:
    weight = initial_head_weight(args.d_model, args.seed)
    return train(batches, args, lambda: LocalHead(weight, args), "local")


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def print_memory(label: str, memory: Memory) -> None:
    parts = ", ".join(f"{kind} {human_bytes(size)}" for kind, size in memory.items())
    print(f"  {label:32s} {parts}; total {human_bytes(sum(memory.values()))}")


def print_comparison(remote: List[float], local: List[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(remote, local)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    print("step    remote     local      diff")
    for i in sorted(set(list(range(0, len(diffs), max(1, len(diffs) // 10))) + [len(diffs) - 1])):
        print(f"{i + 1:4d}  {remote[i]:8.4f}  {local[i]:8.4f}  {remote[i] - local[i]:+.4f}")
    rel = diffs[worst] / local[worst]
    print(f"largest |remote - local| loss difference: {diffs[worst]:.4f} at step {worst + 1} "
          f"({rel:.2%} of the loss); mean {sum(diffs) / len(diffs):.4f}; final losses "
          f"{remote[-1]:.4f} vs {local[-1]:.4f}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="127.0.0.1:50051", help="losshead server host:port")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="trunk device")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: a tenth of --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="learning rate at the last step, as a fraction of the peak")
    p.add_argument("--clip", type=float, default=1.0,
                   help="max global gradient norm over trunk and head (0: no clipping)")
    p.add_argument("--client-optimizer", action="store_true",
                   help="run the head's AdamW here on a mirror of W (pull dW, push W every "
                        "step) instead of on the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="weight dtype of the remote head")
    p.add_argument("--wire-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="dtype of hidden states and dH on the wire")
    p.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per micro-batch sent to the server (larger batches are chunked)")
    p.add_argument("--streams", type=int, default=4, help="Step streams for the chunks")
    p.add_argument("--connections", type=int, default=0,
                   help="TCP connections for the streams (0: one per stream)")
    p.add_argument("--text", help="training text (default: an installed licence text)")
    p.add_argument("--head-name", help="name of the remote head (default: charlm-<pid>)")
    p.add_argument("--keep-head", action="store_true", help="do not delete the head at the end")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--compare-local", action="store_true",
                   help="also train with a local torch head and compare the loss curves")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = find_text(args.text)
    data = torch.tensor(list(path.read_bytes()), dtype=torch.uint8)
    print(f"text: {path} ({data.numel():,} bytes); model: {args.layers} layers, d_model "
          f"{args.d_model}; {args.accum} x {args.batch} x {args.seq_len} tokens per step; "
          f"peak lr {args.lr:g} (warm-up {args.warmup} steps, cosine to {args.min_lr_ratio:g}x), "
          f"clip {args.clip:g}", flush=True)
    batches = make_batches(data, args.steps, args.accum, args.batch, args.seq_len, args.seed)

    t0 = time.perf_counter()
    remote, remote_memory = train_remote(batches, args)
    print(f"remote head: {time.perf_counter() - t0:.1f}s; loss {remote[0]:.4f} -> "
          f"{remote[-1]:.4f}", flush=True)
    local = None
    if args.compare_local:
        t0 = time.perf_counter()
        local, local_memory = train_local(batches, args)
        print(f"local head:  {time.perf_counter() - t0:.1f}s; loss {local[0]:.4f} -> "
              f"{local[-1]:.4f}", flush=True)

    print(f"memory held for the 256 x {args.d_model} head on the trainer:")
    print_memory((MirrorHead if args.client_optimizer else ServerOptimizerHead).label,
                 remote_memory)
    if not args.client_optimizer:
        print_memory("(the mirror path would hold)", mirror_memory(256, args.d_model))
    if local is not None:
        print_memory(LocalHead.label, local_memory)
        print_comparison(remote, local)
    return 0


if __name__ == "__main__":
    sys.exit(main())
