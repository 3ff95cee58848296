"""trainer_bench's one run: the model, the data, the Trainer, the timing and the statistics
(`python3 trainer_bench.py run ...` executes `run_one` in a process of its own)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

W_SAMPLE_SEED = 20261127
TRUNK_SAMPLES = 256


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
    rows, seq, vocab = args.steps * args.batch * args.ranks, args.seq_len, args.vocab
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
    if args.ranks != int(os.environ.get("WORLD_SIZE", "1")):
        raise SystemExit(f"trainer_bench: --ranks {args.ranks} runs under torchrun with as many "
                         "processes (`all` starts it)")
    if args.ranks > 1 and (args.resume or args.save_at):
        raise SystemExit("trainer_bench: --save-at and --resume are single-rank runs")
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


def _offload(args: argparse.Namespace, torch: Any, model: Any,
             creator: bool) -> Tuple[Any, Any, Dict[str, Any]]:
    """Client, OffloadedHead and what was done: the head created (or, resuming, attached to).
    Of several ranks only rank 0 (`creator`) creates the head; the others attach to it."""
    import grpc
    from losshead import Client, LossheadError
    from losshead.integrations.transformers import offload_lm_head

    client = Client(args.server)
    try:
        client.wait_until_serving(60)
    except Exception as e:
        raise SystemExit(f"trainer_bench: no losshead server serving at {args.server} ({e})")
    create = creator and not args.resume
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
    elif args.replace_head and creator:
        with contextlib.suppress(LossheadError):
            client.delete_head(args.head)
    try:
        offloaded = offload_lm_head(model, client, args.head, create=create,
                                    head_dtype=torch.bfloat16, wire_dtype=torch.bfloat16,
                                    chunk_tokens=args.chunk_tokens, streams=args.streams,
                                    replicas=args.replicas)
    except LossheadError as e:
        if e.code == grpc.StatusCode.ALREADY_EXISTS:
            raise SystemExit(f"trainer_bench: head {args.head!r} exists on {args.server}; pass "
                             "--replace-head (or another --head)") from None
        raise
    return client, offloaded, note


def _peak_memory(torch: Any, ranks: int) -> Dict[str, float]:
    """The process's peak GPU memory (MiB); of several ranks, the largest of each figure."""
    peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                         dtype=torch.float64, device="cuda")
    if ranks > 1:
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    allocated, reserved = (float(x) / 2 ** 20 for x in peaks.tolist())
    return {"peak_allocated_mib": allocated, "peak_reserved_mib": reserved}


def run_one(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """One run; its results on rank 0, None on the other ranks."""
    _check_run_args(args)
    torch, transformers = _import_training_stack()
    rank = int(os.environ.get("RANK", "0"))
    if args.ranks > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    args.name = args.name or args.mode
    result: Dict[str, Any] = {
        "name": args.name, "mode": args.mode, "config": vars(args).copy(),
        "device": torch.cuda.get_device_name(), "versions": _versions(),
        "ranks": args.ranks, "tokens_per_step": args.batch * args.seq_len * args.ranks}

    t0 = time.perf_counter()
    model = build_model(transformers, torch, args)
    result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    result["parameter_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    result["parameters"] = {"trunk": sum(p.numel() for p in model.model.parameters()),
                            "head": model.lm_head.weight.numel()}
    output_dir = args.output_dir
    temporary = None
    if output_dir is None:
        import tempfile
        temporary = tempfile.mkdtemp(prefix="trainer-bench-")
        output_dir = temporary
    # Under torchrun the arguments start the process group, which the head's creation needs.
    training = training_arguments(transformers, torch, args, output_dir, args.save_at)
    client = offloaded = None
    if args.mode == "offloaded":
        if rank != 0:
            torch.distributed.barrier()  # rank 0 creates (or replaces) the head first
        client, offloaded, result["head_setup"] = _offload(args, torch, model, rank == 0)
        if rank == 0 and args.ranks > 1:
            torch.distributed.barrier()
        from losshead import native_available
        result["native_client"] = native_available()
    dataset = make_dataset(torch, args)
    losses: List[Tuple[int, Any]] = []
    callback = _bench_callback(transformers, torch, args.name, args.save_at,
                               args.print_every if rank == 0 else 0, losses)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset,
                                   callbacks=[callback])
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

    if rank == 0:
        print(f"[{args.name}] training: {args.steps} steps of {args.ranks} x {args.batch} x "
              f"{args.seq_len} tokens"
              + (f", resuming from {args.resume}" if args.resume else "")
              + (f", saving at step {args.save_at}" if args.save_at else ""), flush=True)
    t_train = time.perf_counter()
    try:
        output = trainer.train(resume_from_checkpoint=args.resume)
    finally:
        torch.cuda.synchronize()
        train_wall = time.perf_counter() - t_train
    result["memory"] = _peak_memory(torch, args.ranks)
    if rank != 0:
        if client is not None:
            client.close()
        torch.distributed.barrier()  # rank 0 reads W and deletes the head after every rank ends
        return None

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
    if args.ranks > 1:
        torch.distributed.barrier()
    if client is not None:
        if args.delete_head:
            with contextlib.suppress(Exception):
                client.delete_head(args.head)
        client.close()
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    return result


