#!/usr/bin/env python3
"""Train a Hugging Face Llama whose 128256 x 4096 LM head lives on a losshead server.

The model is built from a LlamaConfig (nothing is downloaded): Llama-3-8B's vocabulary and hidden
size, so the head is the real size (525 M parameters, 1 GiB in bf16), over a small trunk (2
layers, intermediate size 1024 by default). One call, `offload_lm_head`, moves the head to the
server; the trunk trains locally with AdamW (fp32 weights, bf16 autocast) and the head with
RemoteAdamW, whose step runs on the server. The data are random tokens, or a text file read as
bytes (token = byte value). Prints the loss, the step time and the trainer's peak GPU memory
per step; at the end the trained head comes back into the model, which `--save DIR` writes as a
normal checkpoint.

    python3 client/python/examples/train_hf_llama.py --server 127.0.0.1:50051 --steps 20

Needs transformers (and a CUDA device for the default size; `--device cpu` with small
`--vocab`/`--hidden` runs anywhere).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Iterator, Optional, Sequence

import torch

from losshead import Client, LossheadError, RemoteAdamW
from losshead.integrations.transformers import offload_lm_head


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama of the given shape, initialised from `args.seed`, directly on the device."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq_len, 2048),
        tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    # Built where it trains: initialising 1 G parameters on the CPU would take longer than the run.
    placement = device if hasattr(torch.device, "__enter__") else contextlib.nullcontext()
    with placement:
        model = transformers.LlamaForCausalLM(config)
    return model.to(device)


def batches(args: argparse.Namespace) -> Iterator[torch.Tensor]:
    """(batch, seq_len) token windows: random tokens, or byte windows of --text."""
    g = torch.Generator().manual_seed(args.seed + 1)
    if args.text:
        data = torch.tensor(bytearray(open(args.text, "rb").read()), dtype=torch.long)
        if data.numel() <= args.seq_len:
            raise SystemExit(f"--text {args.text}: fewer than {args.seq_len + 1} bytes")
        offsets = torch.arange(args.seq_len)
        while True:
            starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=g)
            yield data[starts[:, None] + offsets]
    while True:
        yield torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="127.0.0.1:50051", help="losshead server host:port")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", help="train on this file's bytes (default: random tokens)")
    p.add_argument("--head-name", default=f"hf-llama-{os.getpid()}")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--streams", type=int, default=4, help="Step streams (and connections)")
    p.add_argument("--save", help="save_pretrained the trained model (head restored) here")
    p.add_argument("--keep-head", action="store_true", help="leave the head on the server")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    client = Client(args.server, connections=args.streams)
    client.wait_until_serving(timeout=60)
    model = build_model(args)
    with contextlib.suppress(LossheadError):
        client.delete_head(args.head_name)  # a leftover of an interrupted run
    # The head trains in bf16 with fp32 master weights on the server, as the trunk does here.
    offloaded = offload_lm_head(model, client, args.head_name, head_dtype=torch.bfloat16,
                                chunk_tokens=args.chunk_tokens, streams=args.streams)
    info = client.get_head(args.head_name)
    trunk = sum(p.numel() for p in model.parameters())
    print(f"head {args.head_name!r}: {info.spec.vocab_size} x {info.spec.hidden_size} bf16 on "
          f"{info.device} at {args.server}; trunk {trunk / 1e6:.0f} M parameters on {device}; "
          f"{args.batch} x {args.seq_len} tokens per step", flush=True)
    trunk_opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    head_opt = RemoteAdamW(client, args.head_name, lr=args.lr, betas=(0.9, 0.95),
                           weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    data = batches(args)
    try:
        for step in range(1, args.steps + 1):
            tokens = next(data).to(device)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast:
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            trunk_opt.step()
            head_opt.step()  # on the server: dW / tokens, AdamW, W rounded to bf16
            trunk_opt.zero_grad(set_to_none=True)
            value = loss.detach().item()
            if cuda:
                torch.cuda.synchronize(device)
            ms = (time.perf_counter() - t0) * 1e3
            peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else float("nan")
            print(f"step {step:4d}  loss {value:.4f}  {ms:7.1f} ms  "
                  f"{tokens.numel() / ms * 1e3:,.0f} tokens/s  peak {peak:.2f} GiB", flush=True)
        version = offloaded.restore(model)  # the trained head back into lm_head.weight
        print(f"head restored into the model (weights version {version})")
        if args.save:
            model.save_pretrained(args.save)
            print(f"saved to {args.save}")
    finally:
        if not args.keep_head:
            client.delete_head(args.head_name)
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
