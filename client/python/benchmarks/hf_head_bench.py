"""What offloading a real-sized LM head saves a trainer: one model, three heads, one table.

A Llama built from a config (Llama-3-8B's vocabulary and hidden size, V = 128256 and D = 4096,
over a small trunk; nothing is downloaded) trains for `--steps` steps from the same seed on the
same batches, three times:

  (a) eager       the model's own head: lm_head + Hugging Face's loss (the N x V logits exist)
  (b) compiled    the trunk, then the head as a torch.compile'd function of the hidden states
                  (F.linear + F.cross_entropy, as benchmarks/bridge_bench.py's local head)
  (c) losshead    the head offloaded by `offload_lm_head` to the server at --server, stepped
                  there by RemoteAdamW

Each trains the trunk with AdamW (fp32 weights, bf16 autocast); (a) and (b) train the head with
it too. Per variant: the trainer's peak GPU memory over the run (torch.cuda.max_memory_allocated,
reset per variant, the model built afresh), the resident memory before the first step, the
median step time after `--warmup` steps (forward, backward and both optimizer steps), and the
loss per step; then the largest and mean difference between the loss curves of (a) and (c) (and
of (a) and (b): the band that rounding alone opens between two local heads). A markdown table is
printed and everything goes to `--json`.

    python3 client/python/benchmarks/hf_head_bench.py --server 127.0.0.1:50051 --json hf.json

The server may share the trainer's GPU (its memory is its own process's, outside the trainer's
peak) or have its own: on a 2-GPU machine start it with CUDA_VISIBLE_DEVICES=1 and run this on
cuda:0.

It also runs on the CPU at a tiny size (`--device cpu --vocab 512 --hidden 64 --layers 1
--seq-len 32 --batch 2 --steps 10`), and without transformers (`--model fake`, the default when
it is missing) on a hand-written model of the same layout: a check of the script end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from losshead import Client, LossheadError, RemoteAdamW, native_available
from losshead.integrations.causal_lm import causal_targets, offload_causal_lm

VARIANTS = {"a": "eager", "b": "compiled", "c": "losshead"}


# -- the model -----------------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))
                ).to(x.dtype)


class _Block(nn.Module):
    """Pre-norm causal self-attention and a gated SiLU MLP, as in Llama (without rotary
    positions, which a timing and loss-agreement check does not need)."""

    def __init__(self, d: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = _RMSNorm(d), _RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class _FakeTrunk(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleList(_Block(args.hidden, args.heads, args.intermediate)
                                    for _ in range(args.layers))
        self.norm = _RMSNorm(args.hidden)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> SimpleNamespace:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return SimpleNamespace(last_hidden_state=self.norm(x))


class FakeCausalLM(nn.Module):
    """Hugging Face's layout (`.model`, `.lm_head`, `.config`) and loss, without the library."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=args.vocab, hidden_size=args.hidden,
                                      tie_word_embeddings=False)
        self.model = _FakeTrunk(args)
        self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                **kwargs: Any) -> SimpleNamespace:
        logits = self.lm_head(self.model(input_ids).last_hidden_state).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                                   labels[..., 1:].reshape(-1), ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The model of `args`, initialised from `args.seed` directly on `device`."""
    torch.manual_seed(args.seed)
    placement = device if hasattr(torch.device, "__enter__") else contextlib.nullcontext()
    if args.model == "hf":
        import transformers
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq_len, 2048),
            tie_word_embeddings=False, use_cache=False)
        with placement:
            model = transformers.LlamaForCausalLM(config)
    else:
        with placement:
            model = FakeCausalLM(args)
    return model.to(device)


def make_batches(args: argparse.Namespace) -> List[torch.Tensor]:
    """`steps` batches of (batch, seq_len) tokens: byte windows of --text (token = byte value),
    else of the installed torch package's Python sources, a text every host has."""
    if args.text:
        raw = Path(args.text).read_bytes()
    else:
        sources = sorted(Path(torch.__file__).parent.glob("nn/modules/*.py"))
        raw = b"".join(p.read_bytes() for p in sources)
    data = torch.tensor(bytearray(raw), dtype=torch.long) % args.vocab
    if data.numel() <= args.seq_len:
        raise SystemExit(f"the text has fewer than {args.seq_len + 1} bytes")
    g = torch.Generator().manual_seed(args.seed + 1)
    offsets = torch.arange(args.seq_len)
    return [data[torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=g)[:, None]
                 + offsets] for _ in range(args.steps)]


# -- one variant ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compiled_head(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trunk, then the head as one torch.compile'd function of the hidden states."""
    weight = model.lm_head.weight

    def head_loss(hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, w).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)

    compiled = torch.compile(head_loss)

    def loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = model.model(input_ids=tokens).last_hidden_state
        return compiled(hidden, weight, causal_targets(labels))

    return loss


def run_variant(key: str, args: argparse.Namespace, batches: List[torch.Tensor],
                device: torch.device) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    model = build_model(args, device)
    client: Optional[Client] = None
    head_opt: Optional[RemoteAdamW] = None
    head = f"{args.head_prefix}-{os.getpid()}-{key}"
    result: Dict[str, Any] = {"variant": key, "name": VARIANTS[key]}
    try:
        if key == "c":
            client = Client(args.server, connections=args.streams)
            with contextlib.suppress(LossheadError):
                client.delete_head(head)
            offload = offload_causal_lm
            if args.model == "hf":
                from losshead.integrations.transformers import offload_lm_head
                offload = offload_lm_head
            offload(model, client, head, head_dtype=torch.bfloat16, chunk_tokens=args.chunk_tokens,
                    streams=args.streams)
            head_opt = RemoteAdamW(client, head, lr=args.lr, betas=(0.9, 0.95),
                                   weight_decay=args.weight_decay)
        if key == "b":
            loss_fn = _compiled_head(model)
        else:
            def loss_fn(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return model(input_ids=tokens, labels=labels).loss
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            result["resident_mib"] = torch.cuda.memory_allocated(device) / 2 ** 20
        losses, times = [], []
        for tokens in batches:
            tokens = tokens.to(device)
            _sync(device)
            t0 = time.perf_counter()
            with autocast:
                loss = loss_fn(tokens, tokens)
            loss.backward()
            opt.step()
            if head_opt is not None:
                head_opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().item())
            _sync(device)
            times.append(time.perf_counter() - t0)
        timed = times[args.warmup:] or times
        result.update(losses=losses, step_ms=statistics.median(timed) * 1e3,
                      tokens_per_s=batches[0].numel() / statistics.median(timed))
        if cuda:
            result["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        if client is not None:
            info = client.get_head(head)
            m = info.memory
            result["server"] = {"device": info.device, "weights_version": info.weights_version,
                                "memory_mib": {k: getattr(m, k) / 2 ** 20 for k in (
                                    "weights_bytes", "gradient_bytes", "workspace_bytes",
                                    "master_weights_bytes", "optimizer_state_bytes")}}
    finally:
        if client is not None:
            with contextlib.suppress(LossheadError):
                client.delete_head(head)
            client.close()
        del model
    return result


def compare(a: List[float], b: List[float]) -> Dict[str, float]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return {"max_abs": diffs[worst], "max_at_step": worst + 1,
            "max_rel": diffs[worst] / abs(a[worst]), "mean_abs": sum(diffs) / len(diffs)}


def table(results: List[Dict[str, Any]]) -> str:
    lines = ["| head | peak GPU memory (GiB) | resident before step 1 (GiB) | median step (ms) "
             "| tokens/s | loss: first -> last |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| ({r['variant']}) {r['name']} | skipped: {r['skipped']} | | | | |")
            continue
        peak = f"{r['peak_mib'] / 1024:.2f}" if "peak_mib" in r else "-"
        resident = f"{r['resident_mib'] / 1024:.2f}" if "resident_mib" in r else "-"
        lines.append(f"| ({r['variant']}) {r['name']} | {peak} | {resident} | "
                     f"{r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="losshead server host:port for (c)")
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["hf", "fake"], default="hf" if _has_transformers()
                   else "fake", help="transformers' LlamaForCausalLM or the hand-written one")
    p.add_argument("--variants", default="a,b,c", help="comma-separated among a, b, c")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median time")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", help="train on this file's bytes (default: torch's sources)")
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--streams", type=int, default=4, help="Step streams (and connections)")
    p.add_argument("--head-prefix", default="hf-bench")
    args = p.parse_args()
    if args.model == "hf" and not _has_transformers():
        raise SystemExit("--model hf needs transformers; --model fake runs without it")

    device = torch.device(args.device)
    batches = make_batches(args)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"{args.model} model: V={args.vocab} D={args.hidden} layers={args.layers} "
          f"intermediate={args.intermediate}; {args.batch} x {args.seq_len} tokens per step, "
          f"{args.steps} steps, bf16 autocast on {device} ({gpu}); server {args.server} "
          f"(native client: {native_available()})", flush=True)
    results = []
    for key in args.variants.split(","):
        if key == "b" and not hasattr(torch, "compile"):
            results.append({"variant": key, "name": VARIANTS[key],
                            "skipped": f"torch {torch.__version__} has no torch.compile"})
            continue
        t0 = time.perf_counter()
        r = run_variant(key, args, batches, device)
        results.append(r)
        print(f"({key}) {r['name']}: {time.perf_counter() - t0:.1f}s, median step "
              f"{r['step_ms']:.1f} ms, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
              flush=True)
    by_key = {r["variant"]: r for r in results if "losses" in r}
    comparisons = {}
    for pair in (("a", "c"), ("a", "b")):
        if all(k in by_key for k in pair):
            comparisons[f"{pair[0]}-{pair[1]}"] = compare(by_key[pair[0]]["losses"],
                                                         by_key[pair[1]]["losses"])
    print()
    print(table(results))
    for name, c in comparisons.items():
        print(f"\nloss curves {name}: max |diff| {c['max_abs']:.4f} at step {c['max_at_step']} "
              f"({c['max_rel']:.2%} of the loss), mean |diff| {c['mean_abs']:.4f}")
    Path(args.json).write_text(json.dumps({
        "config": vars(args), "device": gpu, "torch": torch.__version__,
        "native_client": native_available(), "results": results, "comparisons": comparisons},
        indent=1))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
