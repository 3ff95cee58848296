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

Data parallel: `--ranks N` runs each of the local and offloaded runs as N processes under
torchrun, one GPU each (DDP; --batch rows per rank, N x --batch per step; the dataset grows to
match). Rank 0 creates the head and the others attach to it; the Trainer's loop steps it once
per global step. `--replicas N` replicates the head over N of the server's GPUs. The peak memory
reported is the largest rank's; the per-step losses are rank 0's micro-batches (the same rows in
both runs). On a 2-GPU host, the server on both GPUs:

    python3 client/python/benchmarks/trainer_bench.py all --server 127.0.0.1:50051 \\
        --ranks 2 --replicas 2 --runs local,offloaded --steps 200 --out /tmp/trainer-bench-2ranks

`summary --out DIR` prints the table again from the JSON files in DIR (it needs neither torch nor
transformers). Needs transformers and accelerate (the Trainer), a CUDA GPU, and the losshead
package (PYTHONPATH=client/python/src); `--help` works without them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from _trainer_bench_report import RUNS, _gib, _write_json, summarize
from _trainer_bench_run import run_one



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
    g.add_argument("--replicas", type=int, default=1,
                   help="server GPUs the offloaded head is replicated over (default 1)")
    g.add_argument("--ranks", type=int, default=1,
                   help="data-parallel ranks, one GPU each (torchrun; `all` starts it); "
                        "--batch is per rank (default 1)")


_SHARED = ("steps", "layers", "vocab", "hidden", "intermediate", "heads", "kv_heads", "batch",
           "seq_len", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "adam_beta2",
           "optim", "attn", "seed", "streams", "chunk_tokens", "timing_warmup", "w_samples",
           "print_every", "ranks", "replicas")


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
    if args.ranks > 1 and not set(runs) <= {"local", "offloaded"}:
        raise SystemExit("trainer_bench: with --ranks > 1 the runs are local and offloaded "
                         "(--runs local,offloaded)")
    _preflight(args, runs)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    script = os.path.abspath(__file__)
    shared = _forward_options(args)
    save_head = f"{args.head_prefix}-save"
    save_dir = os.path.join(args.work_dir, "save")
    for name in runs:
        launcher = [sys.executable]
        if args.ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={args.ranks}"]
        argv = launcher + [script, "run", "--name", name,
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
        if result is None:  # a rank other than 0: rank 0 writes the results
            return
        _write_json(args.out, result)
        t = result["timing"]
        print(f"[{result['name']}] {t.get('steps_per_s', 0):.2f} steps/s (median step "
              f"{t.get('median_step_ms', 0):.1f} ms), peak allocated "
              f"{_gib(result['memory']['peak_allocated_mib'])} GiB, reserved "
              f"{_gib(result['memory']['peak_reserved_mib'])} GiB; written to {args.out}",
              flush=True)


if __name__ == "__main__":
    main()
