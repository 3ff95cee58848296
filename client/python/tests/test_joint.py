"""The torch.optim contract of a server-side head: JointOptimizer (the trunk's optimizer and the
head as one) and RemoteAdamW against the same model with its own head and torch's AdamW.

A learning-rate schedule with warm-up, gradient accumulation (num_items_in_batch) and
clip_grad_norm_ over all parameters must give the local model's weights and norms; a step whose
trunk gradient is not finite (what a GradScaler skips) must apply nothing and leave nothing in
the window; zero_grad discards the window; eval() sends forward-only steps; state_dict /
load_state_dict round-trip the head's optimizer through a server snapshot, also after the server
was killed and restarted; an offloaded model refuses to be copied with the way to do it.
"""

from __future__ import annotations

import copy
import pickle
import re
import signal
import warnings
from pathlib import Path
from typing import List, Tuple

import grpc
import pytest
import torch

from _reference import assert_close
from _servers import ServerFactory
from losshead import (Client, JointOptimizer, LossheadError, RemoteAdamW, RemoteLMHead,
                      UnsteppedHeadWarning)
from losshead._window import tracker
from losshead.integrations.causal_lm import OffloadedHead, offload_causal_lm
from test_integrations import TinyCausalLM, _batch

ADAMW = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
WARMUP, STEPS, ACCUMULATE = 2, 5, 2
MAX_NORM = 0.5
REL = 2e-5  # fp32 everywhere (head, wire, trunk); summation orders differ


def _schedule(step: int) -> float:
    """Linear warm-up from 0 over WARMUP steps, then linear decay (the Trainer's default)."""
    if step < WARMUP:
        return step / WARMUP
    return max(0.0, (STEPS - step) / (STEPS - WARMUP))


def _micro_batches(step: int) -> Tuple[list, int]:
    """ACCUMULATE micro-batches of one step and their target tokens (the Trainer's
    num_items_in_batch: the labels after the shift that are not ignored)."""
    batches = [_batch(1000 * step + i) for i in range(ACCUMULATE)]
    tokens = sum(int((labels[..., 1:] != -100).sum()) for _, _, labels in batches)
    return batches, tokens


def _offload(client: Client, model: TinyCausalLM, head: str, **kwargs: object) -> OffloadedHead:
    return offload_causal_lm(model, client, head, head_dtype=torch.float32,
                             wire_dtype=torch.float32, **kwargs)


def _run_step(model: torch.nn.Module, step: int) -> None:
    batches, tokens = _micro_batches(step)
    for input_ids, mask, labels in batches:
        model(input_ids, attention_mask=mask, labels=labels,
              num_items_in_batch=tokens).loss.backward()


@pytest.fixture
def head_names(client: Client, request: pytest.FixtureRequest):
    made: List[str] = []

    def name(suffix: str = "") -> str:
        made.append(f"joint-{request.node.name}{suffix}"[:120].replace("[", "_").replace("]", "_"))
        return made[-1]

    yield name
    for head in made:
        try:
            client.delete_head(head)
        except LossheadError:
            pass


def test_schedule_accumulation_and_clipping_match_a_local_head(client: Client,
                                                               head_names) -> None:
    reference = TinyCausalLM(seed=3)
    model = copy.deepcopy(reference)
    offloaded = _offload(client, model, head_names())
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))
    local = torch.optim.AdamW(reference.parameters(), foreach=False, **ADAMW)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, _schedule) for o in (joint, local)]
    assert joint.head_group["weight_decay"] == ADAMW["weight_decay"]  # the trunk's decay group

    clipped = 0
    for step in range(STEPS):
        _run_step(model, step)
        _run_step(reference, step)
        # The head's lr is the schedule's, warm-up included (0 at the first step).
        assert joint.head_group["lr"] == pytest.approx(local.param_groups[0]["lr"])
        total = joint.clip_grad_norm_(MAX_NORM)
        want = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), MAX_NORM)
        assert_close(total, want, REL, f"total norm at step {step}")
        clipped += float(want) > MAX_NORM
        joint.step()
        local.step()
        for s in schedules:
            s.step()
        joint.zero_grad()
        local.zero_grad()
        result = joint.last_result
        assert result is not None and result.optimizer_step == step + 1
        assert result.token_count == _micro_batches(step)[1]
    assert clipped >= 2, "the clip never engaged: the test would not see a wrong global norm"
    assert_close(offloaded.download_weight(), reference.lm_head.weight, REL, "W")
    for (name, p), (_, q) in zip(sorted(model.model.named_parameters()),
                                 sorted(reference.model.named_parameters())):
        assert_close(p, q, REL, f"trunk {name}")
    assert client.get_head(offloaded.head).optimizer_step == STEPS


def _head_state(client: Client, head: str) -> Tuple[int, int, int]:
    info = client.get_head(head)
    return info.optimizer_step, info.weights_version, info.microbatches_since_pull


def test_a_step_with_a_non_finite_trunk_gradient_applies_nothing(client: Client,
                                                                 head_names) -> None:
    """What a GradScaler skips (an fp16 overflow in the trunk): the clip finds the norm not
    finite, the head is not applied and its window is discarded, so that the next step covers
    its own micro-batches only."""
    model = TinyCausalLM(seed=4)
    offloaded = _offload(client, model, head_names())
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))
    _run_step(model, 0)
    before = _head_state(client, offloaded.head)
    assert before[2] == ACCUMULATE
    next(model.model.parameters()).grad.view(-1)[0] = float("inf")
    total = joint.clip_grad_norm_(MAX_NORM)
    assert not torch.isfinite(total)
    assert _head_state(client, offloaded.head) == (before[0], before[1], 0)
    joint.zero_grad()  # the scaler skipped step(); the loop zeroes as always

    _run_step(model, 1)
    joint.clip_grad_norm_(MAX_NORM)
    joint.step()
    assert joint.last_result.token_count == _micro_batches(1)[1]
    assert _head_state(client, offloaded.head)[0] == before[0] + 1


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler('cpu') needs torch >= 2.3 (Debian 12 has 1.13, "
                           "whose GradScaler is CUDA-only: test_grad_scaler_on_cuda there)")
def test_grad_scaler_skips_the_overflowed_step_and_steps_the_next(client: Client,
                                                                   head_names) -> None:
    _grad_scaler_round(client, head_names(), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_grad_scaler_on_cuda(client: Client, head_names) -> None:
    _grad_scaler_round(client, head_names(), "cuda")


def _scaler(device: str) -> object:
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device, init_scale=1024.0)
    return torch.cuda.amp.GradScaler(init_scale=1024.0)  # torch < 2.3: CUDA only


def _grad_scaler_round(client: Client, head: str, device: str) -> None:
    """The GradScaler protocol around a JointOptimizer and a RemoteAdamW: inf checks recorded
    (no "No inf checks were recorded"), an overflowed step skipped with the head's window
    discarded and the scale lowered, the next step applied once."""
    model = TinyCausalLM(seed=5).to(device)
    offloaded = _offload(client, model, head)
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))

    def scaled_backward(scaler: object, step: int) -> int:
        batches, tokens = _micro_batches(step)
        for input_ids, mask, labels in batches:
            loss = model(input_ids.to(device), attention_mask=mask.to(device),
                         labels=labels.to(device), num_items_in_batch=tokens).loss
            scaler.scale(loss).backward()
        return tokens

    scaler = _scaler(device)
    for step, overflow in enumerate([True, False]):
        tokens = scaled_backward(scaler, step)
        if overflow:
            next(model.model.parameters()).grad.view(-1)[0] = float("inf")
        before = _head_state(client, head)
        scaler.unscale_(joint)
        joint.clip_grad_norm_(MAX_NORM)
        scale = scaler.get_scale()
        scaler.step(joint)
        scaler.update()
        joint.zero_grad()
        after = _head_state(client, head)
        assert after[2] == 0  # nothing left in the window either way
        if overflow:
            assert scaler.get_scale() < scale and after[:2] == before[:2]
        else:
            assert after[0] == before[0] + 1 and joint.last_result.token_count == tokens

    # RemoteAdamW alone under a scaler: its placeholder records a (finite) inf check, so the
    # scaler steps it (before, it asserted "No inf checks were recorded for this optimizer").
    remote = RemoteAdamW(client, head, **ADAMW)
    scaler = _scaler(device)
    scaled_backward(scaler, 3)
    step = client.get_head(head).optimizer_step
    scaler.step(remote)
    scaler.update()
    assert client.get_head(head).optimizer_step == step + 1


def test_zero_grad_discards_the_window(client: Client, head_names) -> None:
    model = TinyCausalLM(seed=6)
    offloaded = _offload(client, model, head_names())
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))
    _run_step(model, 0)
    w = offloaded.download_weight()
    assert _head_state(client, offloaded.head)[2] == ACCUMULATE
    joint.zero_grad()
    assert _head_state(client, offloaded.head) == (0, offloaded.weights_version, 0)
    assert torch.equal(offloaded.download_weight(), w)
    assert all(p.grad is None for p in model.parameters())
    _run_step(model, 1)
    joint.step()
    assert joint.last_result.token_count == _micro_batches(1)[1]
    assert joint.last_result.microbatch_count == ACCUMULATE

    remote = RemoteAdamW(client, offloaded.head, **ADAMW)
    _run_step(model, 2)
    remote.zero_grad()
    assert _head_state(client, offloaded.head)[2] == 0
    remote.step()  # an empty window: nothing to apply, as a parameter without a gradient
    assert remote.last_result is None and client.get_head(offloaded.head).optimizer_step == 1
    # A second optimizer of the same client on the same head: its keys are its own.
    _run_step(model, 3)
    remote.step()
    assert remote.last_result.optimizer_step == 2 and not remote.last_result.replayed


def test_eval_mode_sends_forward_only_steps(client: Client, head_names) -> None:
    """model.eval() with grad enabled: the loss (the server's, on the current W), dH into the
    trunk, and nothing added to the head's window; under no_grad the same without dH."""
    reference = TinyCausalLM(seed=7)
    model = copy.deepcopy(reference)
    offloaded = _offload(client, model, head_names())
    input_ids, mask, labels = _batch(70)
    model.eval()
    reference.eval()
    out = model(input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want = reference(input_ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    assert_close(out.loss, want.loss, REL, "eval loss")
    for (n, p), (_, q) in zip(sorted(model.model.named_parameters()),
                              sorted(reference.model.named_parameters())):
        assert_close(p.grad, q.grad, REL, f"trunk gradient {n} in eval mode")
    assert _head_state(client, offloaded.head)[2] == 0
    with torch.no_grad():
        again = model(input_ids, attention_mask=mask, labels=labels)
    assert_close(again.loss, want.loss, REL, "no_grad eval loss")
    assert _head_state(client, offloaded.head)[2] == 0
    model.train()
    model(input_ids, attention_mask=mask, labels=labels).loss.backward()
    assert _head_state(client, offloaded.head)[2] == 1


def test_a_head_nobody_steps_is_reported(client: Client, head_names) -> None:
    model = TinyCausalLM(seed=8)
    offloaded = _offload(client, model, head_names())
    window = tracker(client.target, offloaded.head)
    window.threshold = 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):  # 6 forward calls, no step
            _run_step(model, step)
    unstepped = [w for w in caught if issubclass(w.category, UnsteppedHeadWarning)
                 and "forward calls ran against" in str(w.message)]
    assert len(unstepped) == 1 and offloaded.head in str(unstepped[0].message)
    assert "attach(trainer)" in str(unstepped[0].message)

    # Stepped every 4 calls: the threshold follows (4 x the longest run), no warning.
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            _run_step(model, step)
            _run_step(model, step + 10)
            joint.step()
            joint.zero_grad()
    assert not [w for w in caught if issubclass(w.category, UnsteppedHeadWarning)]


def test_a_trainer_loop_without_a_stepper_is_told_at_once(client: Client, head_names) -> None:
    """num_items_in_batch is what the Trainer passes: the first such forward with nothing in
    the process to step the head warns, naming attach."""
    model = TinyCausalLM(seed=9)
    _offload(client, model, head_names())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_step(model, 0)
    told = [w for w in caught if issubclass(w.category, UnsteppedHeadWarning)]
    assert len(told) == 1 and "offloaded.attach(trainer)" in str(told[0].message)


def test_copying_an_offloaded_model_says_how(client: Client, head_names) -> None:
    model = TinyCausalLM(seed=10)
    offloaded = _offload(client, model, head_names())
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError) as refused:
            copier(model)
        assert "offloaded.local_head(model)" in str(refused.value)
        assert offloaded.head in str(refused.value)
    with offloaded.local_head(model):
        twin = copy.deepcopy(model)
    assert isinstance(twin.lm_head, torch.nn.Linear)
    assert torch.equal(twin.lm_head.weight.detach(), offloaded.download_weight())
    # A module that only speaks to the head copies by sharing the client.
    remote = RemoteLMHead(client, offloaded.head)
    assert copy.deepcopy(remote).client is client
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(client)


# -- state through server snapshots ----------------------------------------------------------
def _weights(offloaded: OffloadedHead, model: TinyCausalLM) -> dict:
    out = {f"model.{k}": v.clone() for k, v in model.model.state_dict().items()}
    out["lm_head.weight"] = offloaded.download_weight()
    return out


def _assert_same(got: dict, want: dict) -> None:
    """Equal up to the last bits: the CPU server's GEMMs (OpenBLAS, threaded) may round
    differently from one run to the next. A head restored without its moments or step, or to
    another step, is off by orders of magnitude more."""
    assert got.keys() == want.keys()
    for k in want:
        assert_close(got[k], want[k], 1e-6, k)


def _train(model: TinyCausalLM, joint: JointOptimizer, steps: range) -> None:
    for step in steps:
        _run_step(model, step)
        joint.clip_grad_norm_(MAX_NORM)
        joint.step()
        joint.zero_grad()


def test_state_dict_needs_snapshots_on_the_server(client: Client, head_names) -> None:
    model = TinyCausalLM(seed=11)
    offloaded = _offload(client, model, head_names())
    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW))
    before = joint.state_dict()  # no step yet: W is all there is, no snapshot needed
    assert before["losshead"]["snapshot"] is None
    _train(model, joint, range(1))
    with pytest.raises(LossheadError) as refused:
        joint.state_dict()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_state_dict_round_trip_through_a_snapshot(servers: ServerFactory, tmp_path: Path) -> None:
    server = servers.start("--checkpoint_dir", str(tmp_path / "ckpt"))
    with Client(server.address) as client:
        model = TinyCausalLM(seed=12)
        offloaded = _offload(client, model, "round-trip")
        joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False,
                                                      **ADAMW))
        _train(model, joint, range(2))
        saved_weights = _weights(offloaded, model)
        saved = copy.deepcopy(joint.state_dict())
        tag = saved["losshead"]["snapshot"]
        assert tag and [s.tag for s in client.list_snapshots("round-trip")] == [tag]
        _train(model, joint, range(2, 4))
        after = _weights(offloaded, model)
        assert client.get_head("round-trip").optimizer_step == 4

        # Back to step 2: the trunk by its own state dicts, the head by the snapshot.
        model.model.load_state_dict({k[6:]: v for k, v in saved_weights.items()
                                     if k.startswith("model.")})
        joint.load_state_dict(saved)
        assert client.get_head("round-trip").optimizer_step == 2
        _assert_same(_weights(offloaded, model), saved_weights)
        _train(model, joint, range(2, 4))
        _assert_same(_weights(offloaded, model), after)  # moments and step came back too

        # Its own state dict handed straight back (accelerate's prepare) restores nothing.
        own = joint.state_dict()
        version = client.get_head("round-trip").weights_version
        assert joint.stepper.load_reference(own["losshead"]) is False
        assert client.get_head("round-trip").weights_version == version


def test_resume_after_the_server_was_killed(servers: ServerFactory, tmp_path: Path) -> None:
    """Save at step 2, train on to step 4 (the server runs further), kill the server, restart
    it on the same checkpoint directory, and resume from step 2 in a fresh model and client:
    steps 3 and 4 again give the uninterrupted run's weights."""
    ckpt = tmp_path / "ckpt"
    server = servers.start("--checkpoint_dir", str(ckpt))
    with Client(server.address) as client:
        model = TinyCausalLM(seed=13)
        offloaded = _offload(client, model, "resumed")
        joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False,
                                                      **ADAMW))
        _train(model, joint, range(2))
        trunk_state = copy.deepcopy(model.model.state_dict())
        torch.save(joint.state_dict(), tmp_path / "optimizer.pt")
        _train(model, joint, range(2, 4))
        uninterrupted = _weights(offloaded, model)
    server.stop(signal.SIGKILL)
    server = servers.start("--checkpoint_dir", str(ckpt), port=server.port)

    with Client(server.address) as client:
        fresh = TinyCausalLM(seed=99)  # another initialisation: everything must come back
        exists = any(h.spec.name == "resumed" for h in client.list_heads())
        offloaded = _offload(client, fresh, "resumed", create=not exists)
        joint = offloaded.optimizer(torch.optim.AdamW(fresh.parameters(), foreach=False,
                                                      **ADAMW))
        fresh.model.load_state_dict(trunk_state)
        # As the Trainer loads it: plain tensors and containers only (torch 1.13's
        # weights-only loader takes no float at all, not even a torch optimizer's lr).
        weights_only = int(torch.__version__.split(".")[0]) >= 2
        joint.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=weights_only))
        assert client.get_head("resumed").optimizer_step == 2
        _train(fresh, joint, range(2, 4))
        _assert_same(_weights(offloaded, fresh), uninterrupted)


def test_attach_refuses_what_it_cannot_drive(client: Client, head_names) -> None:
    """Checked before anything is hooked, with the reason (no transformers needed: a stand-in
    with the Trainer's attributes)."""
    from types import SimpleNamespace

    model = TinyCausalLM(seed=14)
    offloaded = _offload(client, model, head_names())

    def trainer(**changes: object) -> SimpleNamespace:
        args = dict(save_strategy="steps", save_only_model=False, weight_decay=0.0,
                    label_smoothing_factor=0.0, deepspeed=None)
        args.update(changes.pop("args", {}))
        fields = dict(model=model, args=SimpleNamespace(**args), is_deepspeed_enabled=False,
                      compute_loss_func=None, model_init=None, lr_scheduler=None,
                      optimizer=None, create_optimizer=lambda model=None: None)
        fields.update(changes)
        return SimpleNamespace(**fields)

    cases = [
        (trainer(), "--checkpoint_dir"),  # the session's server keeps no snapshots
        (trainer(args={"label_smoothing_factor": 0.1}), "label_smoothing"),
        (trainer(is_deepspeed_enabled=True), "DeepSpeed"),
        (trainer(model=TinyCausalLM(seed=15)), "not the one"),
        (trainer(compute_loss_func=lambda *a: None), "compute_loss_func"),
        (trainer(lr_scheduler=object()), "scheduler"),
    ]
    for fake, reason in cases:
        with pytest.raises(ValueError, match=re.escape(reason)):
            offloaded.attach(fake)
        assert fake.optimizer is None  # nothing hooked
    with pytest.raises(TypeError, match="Trainer or an accelerate"):
        offloaded.attach(object())
