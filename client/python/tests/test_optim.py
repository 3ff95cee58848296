"""RemoteAdamW / RemoteSGD against torch.optim fed the same gradients, and step_with_clipping
against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import grpc
import pytest
import torch

from losshead import Client, RemoteAdamW, RemoteSGD, step_with_clipping
from losshead.errors import LossheadError

V, D, TOKENS = 37, 16, 24
REL = 1e-6


def _window(client: Client, head: str, step: int) -> torch.Tensor:
    """Two micro-batches (token sums) into the head; the raw dW the next apply will see."""
    g = torch.Generator().manual_seed(1000 + step)
    for _ in range(2):
        hidden = torch.randn(TOKENS, D, generator=g)
        targets = torch.randint(0, V, (TOKENS,), generator=g)
        client.step(head, hidden, targets, hidden_dtype=torch.float32, reduction="sum")
    return client.pull_gradient(head, reset=False).grad


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= REL * want.abs().max().item(), f"max error {err}"


@pytest.mark.parametrize("kind, options", [
    ("adamw", dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)),
    ("sgd", dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(lr=0.3, momentum=0.5, dampening=0.2)),
], ids=["adamw", "sgd_nesterov", "sgd_dampening"])
def test_twenty_steps_match_torch(client: Client, make_head, kind: str, options: dict) -> None:
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(3)) * 0.3
    head = make_head(V, D, weights=w0)
    local = torch.nn.Parameter(w0.clone())
    if kind == "adamw":
        remote = RemoteAdamW(client, head, **options)
        ref = torch.optim.AdamW([local], foreach=False, **options)
    else:
        remote = RemoteSGD(client, head, **options)
        ref = torch.optim.SGD([local], foreach=False, **options)
    # Schedules act on param_groups: the same one drives both.
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.7) for o in (remote, ref)]
    for step in range(1, 21):
        raw = _window(client, head, step)
        local.grad = raw / (2 * TOKENS)
        ref.step()
        remote.step()
        result = remote.last_result
        assert result.token_count == 2 * TOKENS and result.microbatch_count == 2
        assert result.optimizer_step == step and not result.replayed
        for s in schedules:
            s.step()
    assert remote.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"])
    _assert_close(client.download_weights(head).weights, local.detach())
    assert client.get_head(head).optimizer_step == 20


def test_clipping_matches_clip_grad_norm(client: Client, make_head) -> None:
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(4)) * 0.3
    head = make_head(V, D, weights=w0)
    remote = RemoteSGD(client, head, lr=1.0)
    g = torch.Generator().manual_seed(5)
    trunk = [torch.nn.Parameter(torch.randn(20, 10, generator=g)) for _ in range(2)]
    raw = _window(client, head, 0)
    head_grad = raw / (2 * TOKENS)
    for p in trunk:
        p.grad = torch.randn(p.shape, generator=g) * head_grad.norm() * 0.5
    # torch over all parameters, the head's gradient included.
    want_trunk = [p.grad.clone() for p in trunk]
    want_head = head_grad.clone()
    local = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in want_trunk + [want_head]]
    for p, grad in zip(local, want_trunk + [want_head]):
        p.grad = grad
    max_norm = 0.3 * float(torch.sqrt(sum((x.grad.double() ** 2).sum() for x in local)))
    total = torch.nn.utils.clip_grad_norm_(local, max_norm)
    coefficient = step_with_clipping(remote, trunk, max_norm)
    assert coefficient < 1
    assert coefficient == pytest.approx(max_norm / (float(total) + 1e-6), rel=1e-6)
    assert remote.last_result.total_grad_norm == pytest.approx(float(total), rel=1e-6)
    for p, want in zip(trunk, want_trunk):
        _assert_close(p.grad, want)
    # SGD with lr 1: W moved by the clipped head gradient.
    _assert_close(client.download_weights(head).weights, w0 - want_head)


def test_state_dict_round_trips_the_moments_through_a_snapshot(servers, tmp_path) -> None:
    """state_dict names a server snapshot of the head's whole state, load_state_dict restores
    it: the steps after it repeat the first run's W (the moments and step came back, not just a
    step key)."""
    server = servers.start("--checkpoint_dir", str(tmp_path / "ckpt"))
    with Client(server.address) as c:
        w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(8)) * 0.3
        c.create_head("sd", V, D, weight_dtype=torch.float32)
        c.upload_weights("sd", w0)
        remote = RemoteAdamW(c, "sd", lr=0.01)
        for step in (1, 2):
            _window(c, "sd", step)
            remote.step()
        saved = remote.state_dict()
        assert saved["losshead"]["snapshot"] and saved["losshead"]["optimizer_step"] == 2
        for step in (3, 4):
            _window(c, "sd", step)
            remote.step()
        first = c.download_weights("sd").weights

        again = RemoteAdamW(c, "sd", lr=0.01)  # a restarted trainer
        again.load_state_dict(saved)
        assert c.get_head("sd").optimizer_step == 2
        for step in (3, 4):
            _window(c, "sd", step)
            again.step()
            assert not again.last_result.replayed
        assert again.last_result.optimizer_step == 4
        _assert_close(c.download_weights("sd").weights, first)


def test_state_dict_without_snapshots_is_refused(client: Client, make_head) -> None:
    head = make_head(V, D)
    remote = RemoteAdamW(client, head, lr=0.01)
    assert remote.state_dict()["losshead"]["snapshot"] is None  # nothing stepped: W is all
    _window(client, head, 1)
    remote.step()
    with pytest.raises(LossheadError) as refused:
        remote.state_dict()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--checkpoint_dir" in refused.value.message


def test_a_step_past_the_weights_range_is_refused_and_changes_nothing(client: Client,
                                                                        make_head) -> None:
    """An fp16 head at lr 1e7: the step would carry W past 65504. FAILED_PRECONDITION, and W,
    the window and the step count stay as they were; the same step at a sane lr then matches
    torch.optim.SGD on that window."""
    w0 = (torch.randn(V, D, generator=torch.Generator().manual_seed(6)) * 0.3).half().float()
    head = make_head(V, D, weights=w0, dtype=torch.float16)
    remote = RemoteSGD(client, head, lr=1e7)
    raw = _window(client, head, 7)
    before = client.get_head(head)
    with pytest.raises(LossheadError) as refused:
        remote.step()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "would overflow" in refused.value.message and "65504" in refused.value.message
    assert torch.equal(client.download_weights(head).weights.float(), w0)
    after = client.get_head(head)
    assert after.tokens_since_pull == before.tokens_since_pull == 2 * TOKENS
    assert after.optimizer_step == 0 and after.weights_version == before.weights_version
    assert torch.equal(client.pull_gradient(head, reset=False).grad, raw)

    remote.param_groups[0]["lr"] = 0.5
    remote.step()
    assert remote.last_result.optimizer_step == 1 and remote.last_result.token_count == 2 * TOKENS
    local = torch.nn.Parameter(w0.clone())
    local.grad = raw / (2 * TOKENS)
    torch.optim.SGD([local], lr=0.5, foreach=False).step()
    # W is the fp32 master rounded to fp16; the server scales dW by 1 / tokens in fp32 where
    # torch divides, so an element may round to the neighbouring fp16 value.
    got = client.download_weights(head).weights.float()
    assert torch.allclose(got, local.detach(), rtol=2**-10, atol=2**-24)
