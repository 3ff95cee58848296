"""The Hugging Face Trainer with an offloaded head on GPUs: DDP and FSDP over two ranks, and fp16
with its GradScaler, each against the same tiny Llama with its own head under the same Trainer.

- DDP, two ranks (NCCL): the losses, gradient norms and learning rates of every step, the final
  W and trunk, equal the own-head DDP run; the head stepped once per global step (not once per
  rank). Saved at step 4 and resumed in a new pair of processes (the server ran on to step 8),
  the run ends where the uninterrupted one did.
- FSDP2 (trunk fully sharded, head offloaded): the same against the own-head DDP run (the same
  data order: both use the distributed sampler), and the same resume.
- fp16 (one GPU): the trunk's gradients of step 3 hold an inf (as an fp16 overflow leaves them):
  the GradScaler skips that step and halves its scale, and the head skips it too (unstepped, its
  window discarded), exactly as the own-head run does; the runs then train alike.

Needs transformers, accelerate and two CUDA GPUs (fp16: one); elsewhere each case skips with
the reason. The head is fp32 on a CPU server, the trunk fp32 (fp16 under autocast for the fp16
case), so that the comparisons are tight.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Trainer tests need transformers")
accelerate = pytest.importorskip("accelerate", reason="the Trainer tests need accelerate")

from _servers import ServerFactory, free_port  # noqa: E402
from losshead import Client  # noqa: E402
from losshead.integrations.transformers import offload_lm_head  # noqa: E402
from test_hf_trainer import (SAVE_AT, STEPS, Tokens, _assert_close,  # noqa: E402
                             _assert_same_model, _steps, tiny_llama, training_args)

WORLD = 2
POISONED_STEP = 3
REL = 1e-3  # fp32 on the GPU against fp32 on the CPU server; NCCL sums in its own order

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < WORLD,
                              reason=f"needs {WORLD} CUDA GPUs")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FSDP2 = dict(fsdp="full_shard auto_wrap",
             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                          "reshard_after_forward": True})


def _gpu_args(output_dir: str, **overrides: Any) -> Any:
    options: Dict[str, Any] = dict(use_cpu=False, per_device_train_batch_size=2,
                                   gradient_accumulation_steps=2)
    options.update(overrides)
    return training_args(output_dir, **options)


def _train(output_dir: str, address: Optional[str], head: str, resume: Optional[str],
           overrides: Dict[str, Any]) -> Dict[str, Any]:
    """One Trainer run in this process (one rank); its log, W, trunk and the head's step."""
    model = tiny_llama()
    args = _gpu_args(output_dir, **overrides)  # starts the process group under WORLD_SIZE
    client = None
    offloaded = None
    if address is not None:
        client = Client(address)
        # The test created the head; every rank attaches to it.
        offloaded = offload_lm_head(model, client, head, create=False,
                                    head_dtype=torch.float32, wire_dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(1))
    if offloaded is not None:
        trainer = offloaded.attach(trainer)
    if overrides.get("fp16"):
        _poison_step(trainer, model, POISONED_STEP)
    trainer.train(resume_from_checkpoint=resume)
    out: Dict[str, Any] = {"log": trainer.state.log_history}
    if overrides.get("fp16"):
        out["scale"] = float(trainer.accelerator.scaler.get_scale())
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    state = trainer.accelerator.get_state_dict(trainer.model)  # gathers FSDP shards
    out["trunk"] = {k[len("model."):]: v.detach().float().cpu().clone()
                    for k, v in (state or {}).items() if k.startswith("model.")}
    if offloaded is not None:
        out["w"] = offloaded.download_weight().float().cpu()
        out["optimizer_step"] = client.get_head(head).optimizer_step
        out["window"] = client.get_head(head).microbatches_since_pull
        client.close()
    else:
        out["w"] = unwrapped.lm_head.weight.detach().float().cpu().clone()
    return out


def _poison_step(trainer: Any, model: Any, step: int) -> None:
    """An inf in one trunk gradient during global step `step`, as an fp16 overflow leaves it."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if trainer.state.global_step == step - 1 else grad

    model.model.norm.weight.register_hook(hook)


def _rank_main(rank: int, port: int, address: Optional[str], head: str, output_dir: str,
               resume: Optional[str], overrides: Dict[str, Any], result_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD), "NCCL_NVLS_ENABLE": "0"})
    torch.cuda.set_device(rank)
    out = _train(output_dir, address, head, resume, overrides)
    torch.save(out, Path(result_dir) / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _two_ranks(tmp_path: Path, name: str, address: Optional[str], head: str = "",
               resume: Optional[str] = None, **overrides: Any) -> List[Dict[str, Any]]:
    result_dir = tmp_path / f"{name}-results"
    result_dir.mkdir()
    torch.multiprocessing.spawn(
        _rank_main, args=(free_port(), address, head, str(tmp_path / name), resume, overrides,
                          str(result_dir)), nprocs=WORLD, join=True)
    return [torch.load(result_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _create_head(address: str, head: str) -> None:
    """The head every rank attaches to, with the own-head runs' initial W (tiny_llama(0))."""
    with Client(address) as client:
        offload_lm_head(tiny_llama(), client, head, head_dtype=torch.float32,
                        wire_dtype=torch.float32)


def _assert_same_steps(got: Dict[str, Any], want: Dict[str, Any], steps: range) -> None:
    g, w = _steps(got["log"]), _steps(want["log"])
    for step in steps:
        for key in ("loss", "grad_norm", "learning_rate"):
            assert g[step][key] == pytest.approx(w[step][key], rel=REL, abs=1e-7), (
                f"{key} at step {step}")


@pytest.fixture
def server(servers: ServerFactory, tmp_path: Path) -> Any:
    return servers.start("--checkpoint_dir", str(tmp_path / "server-checkpoints"))


@pytest.fixture(scope="module")
def own_head_ddp(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    return _two_ranks(tmp_path_factory.mktemp("own"), "own", None)


@two_gpus
@pytest.mark.parametrize("placement", ["ddp", "fsdp2"])
def test_two_ranks_drive_save_and_resume_the_head(placement: str, server: Any, tmp_path: Path,
                                                  own_head_ddp: List[Dict[str, Any]]) -> None:
    overrides = FSDP2 if placement == "fsdp2" else {}
    head = f"hf-{placement}"
    _create_head(server.address, head)
    ranks = _two_ranks(tmp_path, "run", server.address, head, **overrides)
    want = own_head_ddp[0]
    for got in ranks:
        # Once per global step, not once per rank; nothing left in the window.
        assert got["optimizer_step"] == STEPS and got["window"] == 0
        _assert_same_steps(got, want, range(1, STEPS + 1))
    assert any(_steps(want["log"])[s]["grad_norm"] > 0.3 for s in range(1, STEPS + 1)), (
        "max_grad_norm never clipped")
    _assert_same_model(ranks[0], want, rel=REL)

    # W is in the checkpoint: among the model's weights, or beside FSDP's sharded state.
    checkpoint = str(tmp_path / "run" / f"checkpoint-{SAVE_AT}")
    from safetensors.torch import load_file
    files = ["model.safetensors"] + (["lm_head.safetensors"] if placement == "fsdp2" else [])
    for name in files:
        saved = load_file(os.path.join(checkpoint, name))
        assert tuple(saved["lm_head.weight"].shape) == tuple(want["w"].shape), name

    # Resume from step 4 in a new pair of processes; the server's head is at step 8.
    resumed = _two_ranks(tmp_path, "resumed", server.address, head, resume=checkpoint,
                         **overrides)
    for got in resumed:
        assert got["optimizer_step"] == STEPS  # restored to 4, then 4 more
        _assert_same_steps(got, ranks[0], range(SAVE_AT + 1, STEPS + 1))
    _assert_same_model(resumed[0], ranks[0], rel=REL)


def _fp16_main(address: Optional[str], head: str, output_dir: str, result: str) -> None:
    torch.save(_train(output_dir, address, head, None, {"fp16": True}), result)


def _one_process(tmp_path: Path, name: str, address: Optional[str], head: str = ""
                 ) -> Dict[str, Any]:
    import multiprocessing
    result = tmp_path / f"{name}.pt"
    process = multiprocessing.get_context("spawn").Process(
        target=_fp16_main, args=(address, head, str(tmp_path / name), str(result)))
    process.start()
    process.join(600)
    assert process.exitcode == 0
    return torch.load(result, weights_only=False)


@two_gpus
def test_one_process_over_two_gpus_is_refused(server: Any, tmp_path: Path) -> None:
    # Without a process group the Trainer would wrap the model in DataParallel over every GPU.
    _create_head(server.address, "hf-dp")
    model = tiny_llama()
    with Client(server.address) as client:
        offloaded = offload_lm_head(model, client, "hf-dp", create=False,
                                    head_dtype=torch.float32, wire_dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=_gpu_args(str(tmp_path / "dp")),
                                       train_dataset=Tokens(1))
        assert trainer.args.n_gpu == WORLD
        with pytest.raises(ValueError, match="DataParallel over 2 GPUs"):
            offloaded.attach(trainer)
        assert client.get_head("hf-dp").optimizer_step == 0


@one_gpu
def test_fp16_grad_scaler_skips_an_overflowing_step_for_the_head_too(
        server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one process, one GPU (no DataParallel)
    local = _one_process(tmp_path, "local", None)
    _create_head(server.address, "hf-fp16")
    remote = _one_process(tmp_path, "remote", server.address, "hf-fp16")
    # One skipped step each: the scale was halved once (it grows only after 2000 good steps).
    assert local["scale"] == remote["scale"] == 2.0**15
    # The head stepped on every step but the poisoned one, whose window was discarded.
    assert remote["optimizer_step"] == STEPS - 1
    assert remote["window"] == 0
    g, w = _steps(remote["log"]), _steps(local["log"])
    for step in range(1, STEPS + 1):
        assert g[step]["loss"] == pytest.approx(w[step]["loss"], rel=5e-3), step
    # Had the head stepped on the poisoned step (or applied its window later), W would be a
    # whole AdamW step (lr 5e-3 per element) away from the own head's. The trunks are not
    # compared: the own head's dH is fp16 (autocast) and the server's fp32, and AdamW turns such
    # differences in a rarely seen embedding row's tiny gradient into whole steps of lr.
    _assert_close(remote["w"], local["w"], "lm_head.weight", rel=2e-2)
