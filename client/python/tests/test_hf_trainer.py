"""The Hugging Face Trainer and accelerate driving an offloaded head, against the same tiny Llama
with its own head (built from a config, no downloads), on a CPU server with --checkpoint_dir.

- The Trainer's loop (warm-up and linear schedule, gradient accumulation with
  num_items_in_batch, max_grad_norm, AdamW with weight decay) gives the local model's losses,
  gradient norms, learning rates and weights; the head is stepped once per global step;
  evaluate() leaves the head's window alone; save_total_limit prunes the server's snapshots;
  a checkpoint loads with from_pretrained, lm_head.weight included.
- Save at step 4, train to step 8, then resume from step 4 in a new process (the server ran
  further; in the second case it was also killed and restarted): the resumed run ends where
  the uninterrupted one did.
- Phi's lm_head has a bias: the same loop, checkpoint and resume with b on the server (stepped
  without weight decay, as the Trainer's no-decay group steps a local bias).
- accelerate with two processes (gloo), every rank stepping the prepared optimizer and clipping
  with accelerator.clip_grad_norm_: one process over the concatenated batch.

Runs where transformers and accelerate are installed (the GPU host); elsewhere it skips. The
Trainer runs on the CPU (use_cpu) so that the comparisons are exact up to summation order.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Trainer tests need transformers")
accelerate = pytest.importorskip("accelerate", reason="the Trainer tests need accelerate")

from _servers import ServerFactory, free_port  # noqa: E402
from losshead import Client  # noqa: E402
from losshead.integrations.transformers import offload_lm_head  # noqa: E402

V, D, SEQ, ROWS = 96, 32, 12, 32
STEPS, SAVE_AT = 8, 4
REL = 2e-4  # fp32 head, wire and trunk; the Trainer's reductions run in another order


def tiny_llama(seed: int = 0, tied: bool = False) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def tiny_phi(seed: int = 0) -> Any:
    """Phi's layout: LayerNorms, partial rotary, and an lm_head with a bias."""
    config = transformers.PhiConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=0.5,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.PhiForCausalLM(config)
    assert model.lm_head.bias is not None
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 0.5)  # large enough for the loss to depend on it
    return model


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences; about one label in five ignored (-100)."""

    def __init__(self, seed: int, rows: int = ROWS) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (rows, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.rand(rows, SEQ, generator=g) < 0.2] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def training_args(output_dir: str, **overrides: Any) -> Any:
    options = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                   gradient_accumulation_steps=2, learning_rate=5e-3, warmup_steps=2,
                   lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=0.3,
                   optim="adamw_torch", save_strategy="steps", save_steps=SAVE_AT,
                   logging_steps=1, report_to="none", use_cpu=True, seed=0, data_seed=0,
                   dataloader_num_workers=0, disable_tqdm=True)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def _steps(log_history: List[Dict[str, Any]]) -> Dict[int, Dict[str, float]]:
    return {e["step"]: e for e in log_history if "loss" in e}


def run_training(output_dir: str, *, address: Optional[str] = None, head: str = "",
                 create: bool = True, resume: Optional[str] = None, tied: bool = False,
                 phi: bool = False, **overrides: Any) -> Dict[str, Any]:
    """One Trainer run (a tiny Llama, or with `phi` a tiny Phi), offloaded to `head` at
    `address` or (without) with its own head. Returns the log history, the trunk's weights, the
    head's W (and b: None without a bias) and the trainer's evaluation."""
    model = tiny_phi() if phi else tiny_llama(tied=tied)
    offloaded = None
    client = None
    if address is not None:
        client = Client(address)
        offloaded = offload_lm_head(model, client, head, create=create,
                                    head_dtype=torch.float32, wire_dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=training_args(output_dir, **overrides),
                                   train_dataset=Tokens(1), eval_dataset=Tokens(2, rows=8))
    if offloaded is not None:
        trainer = offloaded.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    w, b = (offloaded.download_head() if offloaded is not None
            else (model.lm_head.weight.detach().clone(),
                  None if model.lm_head.bias is None else model.lm_head.bias.detach().clone()))
    out = {"log": trainer.state.log_history,
           "trunk": {k: v.detach().clone() for k, v in model.model.state_dict().items()},
           "w": w, "b": b}
    if offloaded is not None:
        info = client.get_head(head)
        out["window_before_eval"] = info.microbatches_since_pull
        out["optimizer_step"] = info.optimizer_step
    out["eval"] = trainer.evaluate()
    if offloaded is not None:
        out["window_after_eval"] = client.get_head(head).microbatches_since_pull
        client.close()
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL) -> None:
    err = float((got.double() - want.double()).abs().max())
    scale = float(want.double().abs().max()) or 1.0
    assert err <= rel * scale, f"{what}: max error {err} against max |want| {scale}"


def _assert_same_model(got: Dict[str, Any], want: Dict[str, Any], rel: float = REL) -> None:
    _assert_close(got["w"], want["w"], "lm_head.weight", rel)
    assert (got.get("b") is None) == (want.get("b") is None)
    if want.get("b") is not None:
        _assert_close(got["b"], want["b"], "lm_head.bias", rel)
    for name, value in want["trunk"].items():
        if name == "embed_tokens.weight" and name not in got["trunk"]:
            continue  # a tied model's embedding is W, served by the head: compared above
        _assert_close(got["trunk"][name], value, name, rel)


@pytest.fixture
def server(servers: ServerFactory, tmp_path: Path) -> Any:
    return servers.start("--checkpoint_dir", str(tmp_path / "server-checkpoints"))


def test_trainer_drives_the_head_as_it_drives_its_own(server: Any, tmp_path: Path) -> None:
    local = run_training(str(tmp_path / "local"))
    remote = run_training(str(tmp_path / "remote"), address=server.address, head="hf-probe",
                          save_total_limit=1)
    want, got = _steps(local["log"]), _steps(remote["log"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("loss", "grad_norm", "learning_rate"):
            assert got[step][key] == pytest.approx(want[step][key], rel=REL, abs=1e-9), (
                f"{key} at step {step}")
    assert any(want[s]["grad_norm"] > 0.3 for s in want), "max_grad_norm never clipped"
    _assert_same_model(remote, local)
    # The head stepped once per global step; the window was empty after training, and
    # evaluation (forward-only steps) left it so; its loss is the local model's.
    assert remote["optimizer_step"] == STEPS
    assert remote["window_before_eval"] == remote["window_after_eval"] == 0
    assert remote["eval"]["eval_loss"] == pytest.approx(local["eval"]["eval_loss"], rel=REL)

    # save_total_limit=1: checkpoint-8 alone is left, and only its snapshot on the server.
    checkpoints = sorted(p.name for p in (tmp_path / "remote").glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{STEPS}"]
    directory = tmp_path / "remote" / checkpoints[0]
    record = json.loads((directory / "losshead.json").read_text())
    assert record["head"] == "hf-probe" and record["optimizer_step"] == STEPS
    assert record["global_step"] == STEPS and record["optimizer_saved"]
    with Client(server.address) as client:
        assert [s.tag for s in client.list_snapshots("hf-probe")] == [record["snapshot"]]
    # The checkpoint stands alone: from_pretrained without losshead, lm_head.weight included.
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(directory),
                                                                output_loading_info=True)
    assert not info["missing_keys"], info
    assert torch.equal(loaded.lm_head.weight.detach(), remote["w"])


def test_trainer_drives_a_tied_head_as_it_drives_its_own(server: Any, tmp_path: Path) -> None:
    """Llama-3.2's tie: the head serves the input embedding too, and the checkpoint keeps W
    under the embedding's key as the model's own does."""
    local = run_training(str(tmp_path / "local"), tied=True)
    remote = run_training(str(tmp_path / "remote"), address=server.address, head="hf-tied",
                          tied=True)
    want, got = _steps(local["log"]), _steps(remote["log"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=REL, abs=1e-9), (
                f"{key} at step {step}")
    _assert_same_model(remote, local)
    assert "embed_tokens.weight" not in remote["trunk"]
    directory = tmp_path / "remote" / f"checkpoint-{STEPS}"
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(directory),
                                                                output_loading_info=True)
    assert not info["missing_keys"], info
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert torch.equal(loaded.lm_head.weight.detach(), remote["w"])


def test_trainer_drives_a_biased_head_as_it_drives_its_own(server: Any, tmp_path: Path) -> None:
    """Phi: the head holds lm_head.bias; losses, norms, W, b and the trunk as the local model's
    (its bias in the Trainer's no-decay group), and the checkpoint has lm_head.bias."""
    local = run_training(str(tmp_path / "local"), phi=True)
    remote = run_training(str(tmp_path / "remote"), address=server.address, head="hf-phi",
                          phi=True)
    want, got = _steps(local["log"]), _steps(remote["log"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("loss", "grad_norm", "learning_rate"):
            assert got[step][key] == pytest.approx(want[step][key], rel=REL, abs=1e-9), (
                f"{key} at step {step}")
    assert remote["b"] is not None
    _assert_same_model(remote, local)
    assert remote["optimizer_step"] == STEPS
    directory = tmp_path / "remote" / f"checkpoint-{STEPS}"
    loaded, info = transformers.PhiForCausalLM.from_pretrained(str(directory),
                                                              output_loading_info=True)
    assert not info["missing_keys"], info
    assert torch.equal(loaded.lm_head.weight.detach(), remote["w"])
    assert torch.equal(loaded.lm_head.bias.detach(), remote["b"])


def _resume_main(output_dir: str, address: str, head: str, checkpoint: str,
                 result_path: str, phi: bool = False) -> None:
    """The resuming process: a fresh model and client, the head attached (not created)."""
    torch.save(run_training(output_dir, address=address, head=head, create=False,
                            resume=checkpoint, phi=phi), result_path)


def test_resume_of_a_biased_head_ends_where_the_uninterrupted_run_did(
        servers: ServerFactory, tmp_path: Path) -> None:
    """Phi resumed from step 4 in a new process: W and b come back from the checkpoint's files
    (one push) and the snapshot (b's moments with W's), and the run ends where it did."""
    server = servers.start("--checkpoint_dir", str(tmp_path / "server-checkpoints"))
    out = str(tmp_path / "run")
    uninterrupted = run_training(out, address=server.address, head="hf-phi-resume", phi=True)
    result = tmp_path / "resumed.pt"
    process = multiprocessing.get_context("spawn").Process(
        target=_resume_main, args=(out, server.address, "hf-phi-resume",
                                   os.path.join(out, f"checkpoint-{SAVE_AT}"), str(result),
                                   True))
    process.start()
    process.join(600)
    assert process.exitcode == 0
    resumed = torch.load(result, weights_only=False)
    assert resumed["optimizer_step"] == STEPS
    want, got = _steps(uninterrupted["log"]), _steps(resumed["log"])
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
    _assert_same_model(resumed, uninterrupted, rel=1e-5)


@pytest.mark.parametrize("server_restarted", [False, True], ids=["server_ran_on",
                                                                  "server_restarted"])
def test_resume_in_a_new_process_ends_where_the_uninterrupted_run_did(
        servers: ServerFactory, tmp_path: Path, server_restarted: bool) -> None:
    ckpt = tmp_path / "server-checkpoints"
    server = servers.start("--checkpoint_dir", str(ckpt))
    out = str(tmp_path / "run")
    uninterrupted = run_training(out, address=server.address, head="hf-resume")
    assert uninterrupted["optimizer_step"] == STEPS
    if server_restarted:
        server.stop(signal.SIGKILL)
        server = servers.start("--checkpoint_dir", str(ckpt), port=server.port)
        with Client(server.address) as client:
            if not any(h.spec.name == "hf-resume" for h in client.list_heads()):
                model = tiny_llama(seed=5)  # a head to attach to; the restore replaces it
                offload_lm_head(model, client, "hf-resume", head_dtype=torch.float32)
    result = tmp_path / "resumed.pt"
    process = multiprocessing.get_context("spawn").Process(
        target=_resume_main, args=(out, server.address, "hf-resume",
                                   os.path.join(out, f"checkpoint-{SAVE_AT}"), str(result)))
    process.start()
    process.join(600)
    assert process.exitcode == 0
    resumed = torch.load(result, weights_only=False)
    assert resumed["optimizer_step"] == STEPS  # back to 4, then 4 more
    want, got = _steps(uninterrupted["log"]), _steps(resumed["log"])
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
    _assert_same_model(resumed, uninterrupted, rel=1e-5)


# -- accelerate with two processes ----------------------------------------------------------
WORLD = 2


def _accelerate_main(rank: int, address: str, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD)})
    accelerator = accelerate.Accelerator(cpu=True)
    client = Client(address)
    model = tiny_llama()
    if rank != 0:
        torch.distributed.barrier()  # rank 0 creates the head, the others attach to it
    offloaded = offload_lm_head(model, client, "hf-accelerate", create=rank == 0,
                                head_dtype=torch.float32, wire_dtype=torch.float32)
    if rank == 0:
        torch.distributed.barrier()
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1))
    # Not prepared: accelerate would step a prepared schedule once per process.
    schedule = torch.optim.lr_scheduler.LambdaLR(joint, lambda s: min(1.0, (s + 1) / 2))
    model, prepared = accelerator.prepare(model, joint)
    offloaded.attach(accelerator)
    data = Tokens(3, rows=4 * WORLD * 3)
    norms = []
    for step in range(3):
        rows = [data[i] for i in range(step * 4 * WORLD, (step + 1) * 4 * WORLD)]
        tokens = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
        mine = rows[rank * 4:(rank + 1) * 4]
        for pair in (mine[:2], mine[2:]):
            batch = {k: torch.stack([r[k] for r in pair]) for k in pair[0]}
            # Each rank's token sum over the global count, times the ranks (DDP averages).
            loss = model(**batch, num_items_in_batch=tokens).loss * WORLD
            accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.2)))
        prepared.step()
        schedule.step()
        prepared.zero_grad()
    trunk = accelerator.unwrap_model(model).model
    torch.save({"norms": norms, "w": offloaded.download_weight(),
                "trunk": {k: v.detach().clone() for k, v in trunk.state_dict().items()}},
               Path(out_dir) / f"rank{rank}.pt")
    client.close()
    accelerator.end_training()


def test_accelerate_two_processes_equal_one_process(server: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Two CPU processes over gloo: accelerate would address a GPU per process where there is
    # one (its barriers name the local rank's device).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    torch.multiprocessing.spawn(_accelerate_main, args=(server.address, free_port(),
                                                        str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # One process, the whole batch, a local head: AdamW over all parameters, the same schedule,
    # clip_grad_norm_ over all parameters.
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    data = Tokens(3, rows=4 * WORLD * 3)
    norms = []
    for step in range(3):
        rows = [data[i] for i in range(step * 4 * WORLD, (step + 1) * 4 * WORLD)]
        tokens = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        model(**batch, num_items_in_batch=tokens).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        opt.step()
        schedule.step()
        opt.zero_grad()
    with Client(server.address) as client:
        assert client.get_head("hf-accelerate").optimizer_step == 3
    want = {"w": model.lm_head.weight.detach(),
            "trunk": {k: v.detach() for k, v in model.model.state_dict().items()}}
    for rank in ranks:
        assert rank["norms"] == pytest.approx(norms, rel=REL)
        _assert_same_model(rank, want)
