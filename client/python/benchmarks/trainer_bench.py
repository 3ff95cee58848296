"""The Hugging Face Trainer with a Llama-sized head: its own head against one on a losshead server.

A `LlamaForCausalLM` built from a config (Llama-3-8B's head, V = 128256 x D = 4096, over a
`--layers` (2) layer trunk with Llama-3-8B's layer shape; nothing is downloaded) is trained by
`transformers.Trainer` on one GPU, each run in a fresh process so that its peak memory is its own:

  local      the model's own lm_head (its N x V logits and Hugging Face's loss on the trainer)
  offloaded  the head offloaded by `offload_lm_head` (bf16 head, bf16 on the wire) and
             `offloaded.attach(trainer)`: the Trainer's AdamW, cosine schedule, warm-up and
             max_grad_norm drive the head on the server
  save       offloaded again, saving a checkpoint at step K = N / 2 (model, the Trainer's
             optimizer state naming a server snapshot of the head, losshead.json) and running
             on to N
  resumed    a new process: a fresh model, `offload_lm_head(model, client, head, create=False)`
             (the head the save run left at step N), `train(resume_from_checkpoint=checkpoint-K)`
             back to step K (trunk, head W, moments, schedule, data order), then on to N

Measured per run: steps per second (after `--timing-warmup` steps, a checkpoint's writing left
out; also the wall time of trainer.train()), the trainer process's peak GPU memory
(torch.cuda.max_memory_allocated and max_memory_reserved over the whole process), the loss of
every step (unrounded, as the model returned it; the Trainer's log rounds to 4 decimals), the
logged grad_norm and learning rate, and at the end W (a norm, a float64 sum and `--w-samples`
elements at fixed positions) and the trunk's parameters (a norm and samples each); for an
offloaded head also its weights version, optimizer step and the server's memory for it. Then:

  - the loss curves, offloaded against local: the largest |difference| over the N steps and the
    mean |difference| over the last 10;
  - the save run against the offloaded run: the same process twice, the band that run-to-run
    nondeterminism opens (atomics in the trunk's and the head's backward);
  - resumed against the save run (the uninterrupted one): the largest |loss difference| over
    steps K+1..N, and W at N (relative L2 over the sampled elements, relative norm).

Precision: with bf16=True the Trainer keeps the parameters in the dtype they were built in
(LlamaForCausalLM(config) builds fp32; the script makes sure of it) and runs the forward under
torch.autocast(bfloat16) (accelerate's mixed_precision="bf16"): fp32 master weights, bf16
matmuls, which is what the Trainer does by default; the local head's GEMM runs in bf16 from its
fp32 weights and the loss in fp32. The offloaded head is therefore created as bf16 (the server's
AdamW keeps fp32 master weights of it) and the hidden states travel as bf16.

The data: `--steps` x `--batch` rows of `--seq-len` tokens (one epoch, so that a resume skips
batches within it), each row a random phrase of 16..128 tokens repeated to the row's length, the
phrase's tokens drawn from a Zipf(1) distribution over a fixed random order of the vocabulary:
the loss falls at once as the unigram statistics are learnt, and further as the model learns to
copy the phrase; labels = input_ids (the model shifts them). Trainer settings: AdamW
(adamw_torch_fused, betas 0.9 / `--adam-beta2`), lr 3e-4, 10 warm-up steps, cosine schedule,
max_grad_norm 1.0, weight_decay 0.1, logging_steps 1, seed and data_seed 0, no gradient
accumulation.

Disk, at the default size: the checkpoint is about 14 GB (the fp32 trunk and lm_head.weight,
and the trunk's AdamW moments) under --work-dir, the head's snapshot about 7.4 GB (bf16 W, fp32
master weights and moments) under the server's --checkpoint_dir; `all` deletes both at the end
unless --keep-checkpoints.

The server: on the same GPU (its memory is its own process's, outside the trainer's peak), with
--checkpoint_dir for the save and resume runs:

    build/server/losshead-server --backend=cuda --listen=127.0.0.1:50051 --metrics_listen= \\
        --checkpoint_dir=/tmp/losshead-ck &

All four runs and the summary (checkpoints under --work-dir, results and logs under --out):

    python3 client/python/benchmarks/trainer_bench.py all --server 127.0.0.1:50051 \\
        --steps 200 --out /tmp/trainer-bench-results

One run (what `all` starts for each):

    python3 client/python/benchmarks/trainer_bench.py run --mode offloaded \\
        --server 127.0.0.1:50051 --head trainer-bench --steps 200 --out offloaded.json \\
        [--save-at 100 --output-dir /tmp/tb/save] [--resume /tmp/tb/save/checkpoint-100]

`summary --out DIR` prints the table again from the JSON files in DIR (it needs neither torch nor
transformers). Needs transformers and accelerate (the Trainer), a CUDA GPU, and the losshead
package (PYTHONPATH=client/python/src); `--help` works without them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

RUNS = ("local", "offloaded", "save", "resumed")
RUN_TITLES = {"local": "the model's own lm_head",
              "offloaded": "offloaded to losshead",
              "save": "offloaded, saving a checkpoint at step {k}",
              "resumed": "resumed from step {k} in a new process"}
W_SAMPLE_SEED = 20261127
TRUNK_SAMPLES = 256


# -- arguments --------------------------------------------------------------------------------
def _model_and_training_options(p: argparse.ArgumentParser) -> None:
    """The options every run of one comparison must share (`all` passes them on)."""
    g = p.add_argument_group("model and training (shared by every run of a comparison)")
    g.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    g.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    g.add_argument("--vocab", type=int, default=128256)
    g.add_argument("--hidden", type=int, default=4096)
    g.add_argument("--intermediate", type=int, default=14336)
    g.add_argument("--heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    g.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--optim", default=None,
                   help="the Trainer's optim (default adamw_torch_fused, else adamw_torch)")
    g.add_argument("--attn", default=None,
                   help="attn_implementation for the config (default: transformers' choice)")
    g.add_argument("--seed", type=int, default=0, help="model init, Trainer seed and data_seed")
    g.add_argument("--streams", type=int, default=4, help="Step streams of the offloaded head")
    g.add_argument("--chunk-tokens", type=int, default=2048)
    g.add_argument("--timing-warmup", type=int, default=10,
                   help="steps left out of steps/s (at most half of those run)")
    g.add_argument("--w-samples", type=int, default=16384,
                   help="elements of W kept at fixed positions for comparisons")
    g.add_argument("--print-every", type=int, default=20)


_SHARED = ("steps", "layers", "vocab", "hidden", "intermediate", "heads", "kv_heads", "batch",
           "seq_len", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "adam_beta2",
           "optim", "attn", "seed", "streams", "chunk_tokens", "timing_warmup", "w_samples",
           "print_every")


def _forward_options(args: argparse.Namespace) -> List[str]:
    out = []
    for name in _SHARED:
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring for what is measured.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="one Trainer run in this process; writes a JSON file")
    run.add_argument("--mode", choices=["local", "offloaded"], required=True)
    run.add_argument("--name", default=None, help="the run's name in the results (default: mode)")
    run.add_argument("--server", default=None, help="losshead server host:port (offloaded)")
    run.add_argument("--head", default="trainer-bench", help="the server head's name")
    run.add_argument("--replace-head", action="store_true",
                     help="delete a head of that name first (else ALREADY_EXISTS)")
    run.add_argument("--delete-head", action="store_true", help="delete the head at the end")
    run.add_argument("--out", required=True, help="write the results (JSON) here")
    run.add_argument("--output-dir", default=None,
                     help="the Trainer's output_dir (default: a temporary directory)")
    run.add_argument("--save-at", type=int, default=None,
                     help="save a checkpoint (with the optimizer's state) at this step only")
    run.add_argument("--resume", default=None, help="resume_from_checkpoint: a checkpoint-K dir")
    _model_and_training_options(run)

    every = sub.add_parser("all", help="local, offloaded, save and resumed runs, then the table")
    every.add_argument("--server", required=True, help="losshead server host:port")
    every.add_argument("--out", required=True, help="directory for the JSON results and logs")
    every.add_argument("--work-dir", default="/tmp/trainer-bench",
                       help="the Trainer's output dirs, the checkpoint among them")
    every.add_argument("--runs", default=",".join(RUNS),
                       help="comma-separated among local, offloaded, save, resumed "
                            "(resumed needs save in the same call, on the same server)")
    every.add_argument("--save-at", type=int, default=None, help="default: steps // 2")
    every.add_argument("--head-prefix", default="trainer-bench")
    every.add_argument("--keep-checkpoints", action="store_true",
                       help="keep the checkpoint, the save run's head and its snapshots")
    _model_and_training_options(every)

    summary = sub.add_parser("summary", help="the table from the JSON files in --out")
    summary.add_argument("--out", required=True, help="directory that `all` wrote")
    return p.parse_args(argv)


# -- the model and the data (torch and transformers imported by the caller) ----------------------
def build_model(transformers: Any, torch: Any, args: argparse.Namespace) -> Any:
    """LlamaForCausalLM from `args`, initialised from args.seed on the GPU, fp32 parameters."""
    options = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                   intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                   max_position_embeddings=max(4096, args.seq_len), tie_word_embeddings=False,
                   use_cache=False)
    if args.attn:
        options["attn_implementation"] = args.attn
    config = transformers.LlamaConfig(**options)
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    return model.to(device="cuda", dtype=torch.float32)


def make_dataset(torch: Any, args: argparse.Namespace) -> Any:
    """steps x batch rows: a Zipf-drawn phrase of 16..128 tokens repeated over each row."""
    rows, seq, vocab = args.steps * args.batch, args.seq_len, args.vocab
    g = torch.Generator().manual_seed(args.seed + 1)
    order = torch.randperm(vocab, generator=g)  # which ids are frequent
    zipf = torch.arange(1, vocab + 1, dtype=torch.float64).reciprocal()
    lo, hi = min(16, seq), min(128, seq)
    periods = torch.randint(lo, hi + 1, (rows,), generator=g)
    drawn = order[torch.multinomial(zipf, rows * hi, replacement=True, generator=g)]
    ids = torch.empty(rows, seq, dtype=torch.long)
    for r in range(rows):
        p = int(periods[r])
        phrase = drawn[r * hi:r * hi + p]
        ids[r] = phrase.repeat(seq // p + 1)[:seq]

    class PhraseTokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return rows

        def __getitem__(self, i: int) -> Dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i]}

    return PhraseTokens()


def training_arguments(transformers: Any, torch: Any, args: argparse.Namespace, output_dir: str,
                       save_at: Optional[int]) -> Any:
    optim = args.optim or ("adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch")
    options = dict(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine", max_grad_norm=args.max_grad_norm,
        weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=args.adam_beta2, optim=optim,
        bf16=True, logging_steps=1, report_to="none", seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
        save_strategy="steps" if save_at else "no", save_only_model=False)
    if save_at:
        options["save_steps"] = save_at
    return transformers.TrainingArguments(**options)


# -- statistics of tensors ------------------------------------------------------------------------
def tensor_stats(torch: Any, tensor: Any, samples: int, seed: int) -> Dict[str, Any]:
    """A norm, a float64 sum and `samples` elements at positions fixed by `seed` (on the CPU)."""
    flat = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, flat.numel(), (min(samples, flat.numel()),), generator=g)
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
            "norm": float(torch.linalg.vector_norm(flat, dtype=torch.float64)),
            "sum": float(flat.sum(dtype=torch.float64)), "abs_max": float(flat.abs().max()),
            "sample_seed": seed, "sample": flat[idx].tolist()}


def trunk_stats(torch: Any, model: Any) -> Dict[str, Any]:
    out = {}
    for i, (name, param) in enumerate(model.model.named_parameters()):
        out[name] = tensor_stats(torch, param, TRUNK_SAMPLES, W_SAMPLE_SEED + 1 + i)
    return out


# -- one run --------------------------------------------------------------------------------------
def _bench_callback(transformers: Any, torch: Any, name: str, save_at: Optional[int],
                    print_every: int, losses: List[Tuple[int, Any]]) -> Any:
    class BenchCallback(transformers.TrainerCallback):  # type: ignore[misc, name-defined]
        """Times every step (after a device sync), keeps the save at `save_at` only, prints."""

        def __init__(self) -> None:
            self.train_begin: Optional[float] = None
            self.step_end: List[Tuple[int, float]] = []
            self.saves: List[Dict[str, float]] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            self.train_begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # The Trainer reads the loss (.item()) right after this for logging_steps=1, so the
            # sync costs nothing that the step would not pay anyway.
            torch.cuda.synchronize()
            now = time.perf_counter()
            previous = self.step_end[-1][1] if self.step_end else self.train_begin
            self.step_end.append((state.global_step, now))
            if save_at is not None:
                # DefaultFlowCallback also saves at the last step and every save_steps: one
                # checkpoint (about 14 GB at the default size) is what the resume needs.
                control.should_save = state.global_step == save_at
            if print_every and (state.global_step % print_every == 0 or len(self.step_end) == 1):
                loss = float(losses[-1][1]) if losses else float("nan")
                print(f"[{name}] step {state.global_step:5d}/{state.max_steps}  loss {loss:.4f}  "
                      f"{(now - previous) * 1e3:8.1f} ms", flush=True)
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - self.step_end[-1][1]
            self.saves.append({"step": state.global_step, "seconds": seconds})
            print(f"[{name}] checkpoint at step {state.global_step}: {seconds:.1f} s", flush=True)

    return BenchCallback()


def _record_losses(trainer: Any, torch: Any, losses: List[Tuple[int, Any]]) -> None:
    """Keeps every training step's loss as the model returned it (the Trainer logs it rounded to
    4 decimals), as a device tensor read at the end: no extra sync per step."""
    compute_loss = trainer.compute_loss

    def compute_loss_recorded(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = compute_loss(model, inputs, *args, **kwargs)
        if model.training and torch.is_grad_enabled():
            loss = out[0] if isinstance(out, tuple) else out
            losses.append((trainer.state.global_step + 1, loss.detach().float()))
        return out

    trainer.compute_loss = compute_loss_recorded


def _timing(callback: Any, warmup: int) -> Dict[str, Any]:
    if not callback.step_end:
        return {"executed_steps": 0}
    times = [callback.train_begin] + [t for _, t in callback.step_end]
    durations = [b - a for a, b in zip(times, times[1:])]
    save_seconds = {s["step"]: s["seconds"] for s in callback.saves}
    steps = [s for s, _ in callback.step_end]
    for i, step in enumerate(steps):
        if step - 1 in save_seconds:  # this step's time includes the previous step's save
            durations[i] -= save_seconds[step - 1]
    skip = min(warmup, len(durations) // 2)
    steady = durations[skip:]
    ordered = sorted(steady)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (
        ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    return {"executed_steps": len(steps), "first_step": steps[0], "last_step": steps[-1],
            "timed_steps": len(steady), "skipped_steps": skip,
            "steps_per_s": len(steady) / sum(steady), "median_step_ms": median * 1e3,
            "first_step_ms": durations[0] * 1e3, "step_ms": [d * 1e3 for d in durations],
            "saves": callback.saves}


def _versions() -> Dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "accelerate"):
        with contextlib.suppress(Exception):
            out[name] = __import__(name).__version__
    return out


def _check_run_args(args: argparse.Namespace) -> None:
    if args.mode == "offloaded" and not args.server:
        raise SystemExit("trainer_bench: --mode offloaded needs --server host:port")
    if args.mode == "local" and (args.resume or args.save_at):
        raise SystemExit("trainer_bench: --save-at and --resume are for offloaded runs (the "
                         "comparison is between an offloaded run and its own resume)")
    if args.save_at is not None and not 0 < args.save_at < args.steps:
        raise SystemExit(f"trainer_bench: --save-at must be in 1..{args.steps - 1}")
    if args.save_at and not args.output_dir:
        raise SystemExit("trainer_bench: --save-at needs --output-dir (where the checkpoint goes)")
    if args.resume:
        state_file = os.path.join(args.resume, "trainer_state.json")
        if not os.path.isfile(state_file):
            raise SystemExit(f"trainer_bench: {args.resume} is not a Trainer checkpoint (no "
                             "trainer_state.json)")
        with open(state_file) as f:
            step = int(json.load(f)["global_step"])
        if step >= args.steps:
            raise SystemExit(f"trainer_bench: the checkpoint is at step {step}, not before "
                             f"--steps {args.steps}")


def _import_training_stack() -> Tuple[Any, Any]:
    try:
        import torch
        import transformers
        import accelerate  # noqa: F401  (the Trainer needs it; say so here, not mid-run)
    except ImportError as e:
        raise SystemExit(f"trainer_bench: a run needs torch, transformers and accelerate ({e})")
    if not torch.cuda.is_available():
        raise SystemExit("trainer_bench: a run needs a CUDA GPU (bf16 training on cuda)")
    return torch, transformers


def _offload(args: argparse.Namespace, torch: Any, model: Any) -> Tuple[Any, Any, Dict[str, Any]]:
    """Client, OffloadedHead and what was done: the head created (or, resuming, attached to)."""
    import grpc
    from losshead import Client, LossheadError
    from losshead.integrations.transformers import offload_lm_head

    client = Client(args.server)
    try:
        client.wait_until_serving(60)
    except Exception as e:
        raise SystemExit(f"trainer_bench: no losshead server serving at {args.server} ({e})")
    create = not args.resume
    note = {"created": create}
    if args.resume:
        try:
            client.get_head(args.head)
        except LossheadError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            # A server that lost the head (restarted without it): create one to attach to; the
            # checkpoint's weights and snapshot replace it (hf_trainer's resume rule).
            print(f"[{args.name}] head {args.head!r} is not on {args.server}: creating it; the "
                  "checkpoint's snapshot replaces it", flush=True)
            create = True
            note = {"created": True, "created_for_resume": True}
    elif args.replace_head:
        with contextlib.suppress(LossheadError):
            client.delete_head(args.head)
    try:
        offloaded = offload_lm_head(model, client, args.head, create=create,
                                    head_dtype=torch.bfloat16, wire_dtype=torch.bfloat16,
                                    chunk_tokens=args.chunk_tokens, streams=args.streams)
    except LossheadError as e:
        if e.code == grpc.StatusCode.ALREADY_EXISTS:
            raise SystemExit(f"trainer_bench: head {args.head!r} exists on {args.server}; pass "
                             "--replace-head (or another --head)") from None
        raise
    return client, offloaded, note


def run_one(args: argparse.Namespace) -> Dict[str, Any]:
    _check_run_args(args)
    torch, transformers = _import_training_stack()
    args.name = args.name or args.mode
    result: Dict[str, Any] = {
        "name": args.name, "mode": args.mode, "config": vars(args).copy(),
        "device": torch.cuda.get_device_name(), "versions": _versions(),
        "tokens_per_step": args.batch * args.seq_len}

    t0 = time.perf_counter()
    model = build_model(transformers, torch, args)
    result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    result["parameter_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    result["parameters"] = {"trunk": sum(p.numel() for p in model.model.parameters()),
                            "head": model.lm_head.weight.numel()}
    client = offloaded = None
    if args.mode == "offloaded":
        client, offloaded, result["head_setup"] = _offload(args, torch, model)
        from losshead import native_available
        result["native_client"] = native_available()
    dataset = make_dataset(torch, args)
    output_dir = args.output_dir
    temporary = None
    if output_dir is None:
        import tempfile
        temporary = tempfile.mkdtemp(prefix="trainer-bench-")
        output_dir = temporary
    losses: List[Tuple[int, Any]] = []
    callback = _bench_callback(transformers, torch, args.name, args.save_at, args.print_every,
                               losses)
    trainer = transformers.Trainer(
        model=model, args=training_arguments(transformers, torch, args, output_dir, args.save_at),
        train_dataset=dataset, callbacks=[callback])
    with contextlib.suppress(Exception):  # one dict per step on stdout otherwise
        from transformers.trainer_callback import PrinterCallback
        trainer.remove_callback(PrinterCallback)
    if offloaded is not None:
        trainer = offloaded.attach(trainer)
    _record_losses(trainer, torch, losses)
    torch.cuda.synchronize()
    result["setup_s"] = time.perf_counter() - t0
    result["optim"] = str(getattr(trainer.args.optim, "value", trainer.args.optim))
    result["resident_before_train_mib"] = torch.cuda.memory_allocated() / 2 ** 20

    print(f"[{args.name}] training: {args.steps} steps of {args.batch} x {args.seq_len} tokens"
          + (f", resuming from {args.resume}" if args.resume else "")
          + (f", saving at step {args.save_at}" if args.save_at else ""), flush=True)
    t_train = time.perf_counter()
    try:
        output = trainer.train(resume_from_checkpoint=args.resume)
    finally:
        torch.cuda.synchronize()
        train_wall = time.perf_counter() - t_train
        result["memory"] = {"peak_allocated_mib": torch.cuda.max_memory_allocated() / 2 ** 20,
                            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2 ** 20}

    timing = _timing(callback, args.timing_warmup)
    timing["train_wall_s"] = train_wall
    timing["wall_steps_per_s"] = timing["executed_steps"] / train_wall if train_wall else None
    if callback.train_begin is not None:
        timing["before_first_step_s"] = callback.train_begin - t_train  # a resume's loading
    timing["trainer_metrics"] = {k: v for k, v in output.metrics.items()
                                 if isinstance(v, (int, float))}
    result["timing"] = timing
    result["losses"] = [[step, float(loss)] for step, loss in losses]
    logged = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    result["logged"] = [{k: e.get(k) for k in ("step", "loss", "grad_norm", "learning_rate")}
                        for e in logged]
    result["global_step"] = trainer.state.global_step
    if args.resume:
        with open(os.path.join(args.resume, "trainer_state.json")) as f:
            result["resumed_from_step"] = int(json.load(f)["global_step"])
    if args.save_at:
        result["checkpoint"] = os.path.abspath(
            os.path.join(output_dir, f"checkpoint-{args.save_at}"))
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(result["checkpoint"], "losshead.json")) as f:
                result["checkpoint_losshead"] = json.load(f)

    # W and the trunk as trained (after the peak was read: these copies are not the run's).
    if offloaded is not None:
        info = client.get_head(args.head)
        memory = info.memory
        result["head"] = {
            "name": args.head, "device": info.device, "weights_version": info.weights_version,
            "optimizer_step": info.optimizer_step,
            "server_memory_mib": {k: getattr(memory, k) / 2 ** 20 for k in (
                "weights_bytes", "gradient_bytes", "workspace_bytes", "master_weights_bytes",
                "optimizer_state_bytes")}}
        w = offloaded.download_weight()
    else:
        w = model.lm_head.weight
    result["w"] = tensor_stats(torch, w, args.w_samples, W_SAMPLE_SEED)
    del w
    result["trunk"] = trunk_stats(torch, model)
    if client is not None:
        if args.delete_head:
            with contextlib.suppress(Exception):
                client.delete_head(args.head)
        client.close()
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    return result


def _write_json(path: str, obj: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# -- comparisons (plain Python: `summary` needs neither torch nor transformers) -----------------
def loss_by_step(result: Dict[str, Any]) -> Dict[int, float]:
    return {int(step): float(loss) for step, loss in result.get("losses", [])}


def compare_losses(a: Dict[int, float], b: Dict[int, float], first: int = 1,
                   tail: int = 10) -> Optional[Dict[str, Any]]:
    """|a - b| over the steps both ran from `first` on: the largest (and where), the mean, and
    the mean over the last `tail` of them."""
    steps = sorted(s for s in set(a) & set(b) if s >= first)
    if not steps:
        return None
    diffs = [abs(a[s] - b[s]) for s in steps]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    last = diffs[-tail:]
    return {"steps": [steps[0], steps[-1]], "count": len(steps), "max_abs": diffs[worst],
            "max_at_step": steps[worst], "max_rel": diffs[worst] / abs(b[steps[worst]] or 1.0),
            "mean_abs": sum(diffs) / len(diffs), "tail": len(last),
            "tail_mean_abs": sum(last) / len(last), "first_abs": diffs[0]}


def compare_tensors(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """a against b (the reference) from their stats: relative L2 difference and largest
    difference over the shared sampled positions, and the relative difference of the norms."""
    if a.get("sample_seed") != b.get("sample_seed") or a.get("shape") != b.get("shape"):
        return {"comparable": False}
    xa, xb = a["sample"], b["sample"]
    n = min(len(xa), len(xb))
    num = math.sqrt(sum((xa[i] - xb[i]) ** 2 for i in range(n)))
    den = math.sqrt(sum(xb[i] ** 2 for i in range(n))) or 1.0
    return {"comparable": True, "samples": n, "rel_l2": num / den,
            "max_abs": max((abs(xa[i] - xb[i]) for i in range(n)), default=0.0),
            "equal_samples": sum(1 for i in range(n) if xa[i] == xb[i]),
            "norm_rel": abs(a["norm"] - b["norm"]) / (b["norm"] or 1.0)}


def compare_trunks(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    per = {k: compare_tensors(a[k], b[k]) for k in b if k in a}
    worst = max(per, key=lambda k: per[k].get("rel_l2", 0.0), default=None)
    return {"parameters": len(per), "worst": worst,
            "worst_rel_l2": per[worst]["rel_l2"] if worst else None}


def comparisons(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    pairs = [("offloaded_vs_local", "offloaded", "local", 1),
             ("save_vs_offloaded", "save", "offloaded", 1)]
    resumed = results.get("resumed")
    if resumed is not None:
        k = int(resumed.get("resumed_from_step", 0))
        pairs.append(("resumed_vs_uninterrupted", "resumed", "save", k + 1))
    for key, a, b, first in pairs:
        if a not in results or b not in results:
            continue
        ra, rb = results[a], results[b]
        entry: Dict[str, Any] = {"a": a, "b": b,
                                 "loss": compare_losses(loss_by_step(ra), loss_by_step(rb), first)}
        if "w" in ra and "w" in rb:
            entry["w"] = compare_tensors(ra["w"], rb["w"])
        if "trunk" in ra and "trunk" in rb:
            entry["trunk"] = compare_trunks(ra["trunk"], rb["trunk"])
        if "head" in ra and "head" in rb:
            entry["optimizer_step"] = [ra["head"]["optimizer_step"], rb["head"]["optimizer_step"]]
        out[key] = entry
    return out


def _gib(mib: Optional[float]) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


def summary_text(results: Dict[str, Dict[str, Any]], compared: Dict[str, Any]) -> str:
    any_result = next(iter(results.values()))
    c = any_result["config"]
    k = results.get("save", {}).get("config", {}).get("save_at") or (
        results.get("resumed", {}).get("resumed_from_step"))
    lines = [
        f"{any_result.get('device', '?')}; " + ", ".join(
            f"{n} {v}" for n, v in sorted(any_result.get("versions", {}).items())),
        f"LlamaForCausalLM V = {c['vocab']}, D = {c['hidden']}, {c['layers']} layers "
        f"(intermediate {c['intermediate']}, {c['heads']} heads / {c['kv_heads']} KV); "
        f"{c['batch']} x {c['seq_len']} = {c['batch'] * c['seq_len']} tokens per step, "
        f"{c['steps']} steps; fp32 weights, bf16 autocast (Trainer bf16=True); attention "
        f"{any_result.get('attn_implementation')}",
        "",
        "| run | steps run | steps/s | median step (ms) | tokens/s | trainer peak allocated "
        "(GiB) | peak reserved (GiB) | loss: first -> last |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        t, m = r.get("timing", {}), r.get("memory", {})
        losses = r.get("losses") or [[0, float("nan")]]
        title = RUN_TITLES[name].format(k=k)
        rate = t.get("steps_per_s")
        if not rate:
            lines.append(f"| {title} | - | | | | | | |")
            continue
        lines.append(
            f"| {title} | {t['executed_steps']} | {rate:.2f} | {t['median_step_ms']:.1f} | "
            f"{rate * r['tokens_per_step']:,.0f} | {_gib(m.get('peak_allocated_mib'))} | "
            f"{_gib(m.get('peak_reserved_mib'))} | step {losses[0][0]} {losses[0][1]:.4f} -> "
            f"step {losses[-1][0]} {losses[-1][1]:.4f} |")
    lines.append("")
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        t = r.get("timing", {})
        extra = [f"train() {t.get('train_wall_s', 0):.1f} s "
                 f"({t.get('wall_steps_per_s') or 0:.2f} steps/s with everything)",
                 f"first step {t.get('first_step_ms', 0):.0f} ms"]
        for s in t.get("saves", []):
            extra.append(f"checkpoint at step {s['step']}: {s['seconds']:.1f} s")
        if name == "resumed" and "before_first_step_s" in t:
            extra.append(f"loading the checkpoint: {t['before_first_step_s']:.1f} s")
        if "head" in r:
            h = r["head"]
            server = sum(h["server_memory_mib"].values())
            extra.append(f"head at weights version {h['weights_version']}, optimizer step "
                         f"{h['optimizer_step']}; {server / 1024:.2f} GiB on the server "
                         f"({h['device']})")
        lines.append(f"- {name}: " + "; ".join(extra))
    lines.append("")
    texts = {"offloaded_vs_local": "offloaded vs local",
             "save_vs_offloaded": "offloaded vs offloaded again (the save run; run-to-run noise)",
             "resumed_vs_uninterrupted": "resumed vs uninterrupted (the save run)"}
    for key, text in texts.items():
        e = compared.get(key)
        if e is None or e.get("loss") is None:
            continue
        lo = e["loss"]
        line = (f"- {text}, steps {lo['steps'][0]}..{lo['steps'][1]}: max |loss diff| "
                f"{lo['max_abs']:.3g} at step {lo['max_at_step']} ({lo['max_rel']:.3%} of the "
                f"loss), mean {lo['mean_abs']:.3g}, mean over the last {lo['tail']} "
                f"{lo['tail_mean_abs']:.3g}; at step {lo['steps'][0]} {lo['first_abs']:.3g}")
        w = e.get("w")
        if w and w.get("comparable"):
            line += (f". W at the end: relative L2 difference {w['rel_l2']:.3g} over "
                     f"{w['samples']} sampled elements ({w['equal_samples']} equal), norms "
                     f"{w['norm_rel']:.3g} apart")
        trunk = e.get("trunk")
        if trunk and trunk.get("worst"):
            line += (f"; trunk: worst parameter {trunk['worst']} at relative L2 "
                     f"{trunk['worst_rel_l2']:.3g}")
        if "optimizer_step" in e:
            line += f"; head optimizer steps {e['optimizer_step'][0]} / {e['optimizer_step'][1]}"
        lines.append(line)
    return "\n".join(lines)


def load_results(directory: str) -> Dict[str, Dict[str, Any]]:
    results = {}
    for name in RUNS:
        path = os.path.join(directory, f"{name}.json")
        if os.path.isfile(path):
            with open(path) as f:
                results[name] = json.load(f)
    return results


def summarize(directory: str) -> None:
    results = load_results(directory)
    if not results:
        raise SystemExit(f"trainer_bench: no results ({', '.join(RUNS)} .json) in {directory}")
    compared = comparisons(results)
    text = summary_text(results, compared)
    print(text)
    _write_json(os.path.join(directory, "summary.json"), compared)
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(f"\nwritten to {os.path.join(directory, 'summary.md')} and summary.json")


# -- all runs ----------------------------------------------------------------------------------
def _preflight(args: argparse.Namespace, runs: List[str]) -> None:
    """The server serves, and keeps snapshots when a checkpoint will be saved: said before the
    first run rather than minutes into the third."""
    if runs == ["local"]:
        return
    try:
        import grpc
        from losshead import Client, LossheadError
    except ImportError as e:
        raise SystemExit(f"trainer_bench: the losshead package is not importable ({e}); "
                         "PYTHONPATH=client/python/src")
    with Client(args.server) as client:
        try:
            client.wait_until_serving(60)
        except Exception as e:
            raise SystemExit(f"trainer_bench: no losshead server serving at {args.server} ({e})")
        if "save" in runs:
            try:
                client.list_snapshots(f"{args.head_prefix}-probe")
            except LossheadError as e:
                if e.code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise SystemExit(f"trainer_bench: the save run needs a server started with "
                                     f"--checkpoint_dir ({e.message})")
                raise


def _run_subprocess(name: str, argv: List[str], log_path: str) -> None:
    print(f"== {name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if line.startswith(f"[{name}]") or "Error" in line or "error:" in line:
                print(line, end="", flush=True)
        code = process.wait()
    if code != 0:
        with open(log_path) as f:
            tail = f.readlines()[-40:]
        sys.stdout.write("".join(tail))
        raise SystemExit(f"trainer_bench: the {name} run failed (exit {code}); its output is in "
                         f"{log_path}")
    print(f"== {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)


def _cleanup_save_head(server: str, head: str) -> None:
    from losshead import Client, LossheadError

    with Client(server) as client:
        with contextlib.suppress(LossheadError):
            for snapshot in client.list_snapshots(head):
                client.delete_snapshot(head, snapshot.tag)
        with contextlib.suppress(LossheadError):
            client.delete_head(head)


def run_all(args: argparse.Namespace) -> None:
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"trainer_bench: unknown runs {unknown}; choose among {', '.join(RUNS)}")
    if "resumed" in runs and "save" not in runs:
        raise SystemExit("trainer_bench: the resumed run attaches to the head the save run left "
                         "on the server: run both in one call (--runs save,resumed)")
    save_at = args.save_at or args.steps // 2
    if not 0 < save_at < args.steps:
        raise SystemExit(f"trainer_bench: --save-at must be in 1..{args.steps - 1}")
    _preflight(args, runs)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    script = os.path.abspath(__file__)
    shared = _forward_options(args)
    save_head = f"{args.head_prefix}-save"
    save_dir = os.path.join(args.work_dir, "save")
    for name in runs:
        argv = [sys.executable, script, "run", "--name", name,
                "--out", os.path.join(args.out, f"{name}.json")] + shared
        if name == "local":
            argv += ["--mode", "local"]
        elif name == "offloaded":
            argv += ["--mode", "offloaded", "--server", args.server, "--head",
                     f"{args.head_prefix}-offloaded", "--replace-head", "--delete-head"]
        elif name == "save":
            shutil.rmtree(save_dir, ignore_errors=True)  # a checkpoint of an earlier call
            argv += ["--mode", "offloaded", "--server", args.server, "--head", save_head,
                     "--replace-head", "--save-at", str(save_at), "--output-dir", save_dir]
        else:
            argv += ["--mode", "offloaded", "--server", args.server, "--head", save_head,
                     "--resume", os.path.join(save_dir, f"checkpoint-{save_at}"),
                     "--output-dir", os.path.join(args.work_dir, "resumed")]
        _run_subprocess(name, argv, os.path.join(args.out, f"{name}.log"))
    if "save" in runs and not args.keep_checkpoints:
        _cleanup_save_head(args.server, save_head)
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(args.work_dir, "resumed"), ignore_errors=True)
    print()
    summarize(args.out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.command == "summary":
        summarize(args.out)
    elif args.command == "all":
        run_all(args)
    else:
        result = run_one(args)
        _write_json(args.out, result)
        t = result["timing"]
        print(f"[{result['name']}] {t.get('steps_per_s', 0):.2f} steps/s (median step "
              f"{t.get('median_step_ms', 0):.1f} ms), peak allocated "
              f"{_gib(result['memory']['peak_allocated_mib'])} GiB, reserved "
              f"{_gib(result['memory']['peak_reserved_mib'])} GiB; written to {args.out}",
              flush=True)


if __name__ == "__main__":
    main()
