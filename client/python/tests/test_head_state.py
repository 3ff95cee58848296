"""The head's state as a training loop handles it: gradient_summary and discard_gradient (a
trainer's zero_grad) against a float64 torch reference, and named snapshots (snapshot_head,
restore_head, list_snapshots, delete_snapshot) of an AdamW head: a restore puts back W, the
optimizer's master weights and moments, its step count and the version, so that the steps after
it give the uninterrupted run's W bit for bit."""

from __future__ import annotations

from typing import List

import grpc
import pytest
import torch

from losshead import Client, LossheadError

V, D = 29, 12


def _batch(seed: int, tokens: int) -> "tuple[torch.Tensor, torch.Tensor]":
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, D, generator=g)
    targets = torch.randint(0, V, (tokens,), generator=g)
    targets[::5] = -100
    return hidden, targets


def _reference_dw(w: torch.Tensor, batches: List["tuple[torch.Tensor, torch.Tensor]"]
                  ) -> torch.Tensor:
    """Sum over micro-batches of each one's mean-reduced cross-entropy gradient, float64."""
    total = torch.zeros(V, D, dtype=torch.float64)
    for hidden, targets in batches:
        weight = w.double().clone().requires_grad_(True)
        logits = hidden.double() @ weight.T
        torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100).backward()
        total += weight.grad
    return total


def _code(call) -> grpc.StatusCode:
    with pytest.raises(LossheadError) as e:
        call()
    return e.value.code


def test_summary_leaves_the_window_and_discard_drops_it(client: Client, make_head) -> None:
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(1)) * 0.4
    head = make_head(V, D, weights=w)
    version = client.get_head(head).weights_version
    dropped = [_batch(10 + i, 6 + i) for i in range(3)]
    tokens = 0
    for hidden, targets in dropped:
        tokens += client.step(head, hidden, targets, hidden_dtype=torch.float32).token_count

    summary = client.gradient_summary(head)
    assert (summary.microbatch_count, summary.token_count) == (3, tokens)
    assert summary.min_weights_version == summary.max_weights_version == version
    assert summary.total_bytes == 0 and not summary.was_reset
    assert client.get_head(head).microbatches_since_pull == 3  # a summary changes nothing

    discarded = client.discard_gradient(head)
    assert (discarded.microbatch_count, discarded.token_count) == (3, tokens)
    assert discarded.was_reset and discarded.total_bytes == 0
    assert client.gradient_summary(head).microbatch_count == 0
    assert client.discard_gradient(head).microbatch_count == 0  # an empty window discards too

    kept = [_batch(20 + i, 5 + i) for i in range(2)]
    for hidden, targets in kept:
        client.step(head, hidden, targets, hidden_dtype=torch.float32)
    pulled = client.pull_gradient(head, reset=True)
    assert pulled.summary.microbatch_count == 2
    want = _reference_dw(w, kept)
    err = (pulled.grad.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), f"max error {err}"


def test_unknown_head_and_no_checkpoint_dir(client: Client, make_head) -> None:
    assert _code(lambda: client.gradient_summary("no-such-head")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.discard_gradient("no-such-head")) == grpc.StatusCode.NOT_FOUND
    head = make_head(V, D)
    # The session's server runs without --checkpoint_dir.
    for call in (lambda: client.snapshot_head(head, "t"), lambda: client.restore_head(head, "t"),
                 lambda: client.delete_snapshot(head, "t"), lambda: client.list_snapshots(head)):
        assert _code(call) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ValueError):
        client.snapshot_head(head, "")


class _Run:
    """One AdamW head on its own server, trained step by step with fixed micro-batches."""

    def __init__(self, client: Client, head: str) -> None:
        self.client = client
        self.head = head

    def step(self, s: int) -> List[float]:
        losses = []
        for i in range(2):
            hidden, targets = _batch(100 * s + i, 7)
            r = self.client.step(self.head, hidden, targets, hidden_dtype=torch.bfloat16,
                                 sequence=10 * s + i + 1)
            assert not r.replayed
            losses.append(r.loss_sum)
        result = self.client.apply_optimizer(self.head, s, lr=0.02, weight_decay=0.01,
                                             max_norm=1.0, client_id="trainer")
        assert not result.replayed and result.optimizer_step == s
        return losses

    def weights(self) -> torch.Tensor:
        return self.client.download_weights(self.head).weights


def test_snapshot_and_restore_continue_exactly(servers, tmp_path) -> None:
    server = servers.start(f"--checkpoint_dir={tmp_path / 'ckpt'}", "--checkpoint_interval=0",
                           "--grad_stash_idle=inf")
    with Client(server.address, client_id="snapshots") as c:
        c.create_head("h", V, D, weight_dtype=torch.bfloat16, init_std=0.5, seed=3)
        c.set_optimizer("h", "adamw")
        run = _Run(c, "h")
        for s in (1, 2):
            run.step(s)
        info = c.snapshot_head("h", "step-2")
        assert (info.tag, info.head, info.optimizer_step) == ("step-2", "h", 2)
        assert info.weights_version == c.get_head("h").weights_version
        assert info.bytes > V * D * 2 and info.unix_time > 0
        w2 = run.weights()

        losses = [run.step(s) for s in (3, 4)]
        w4, head4 = run.weights(), c.get_head("h")
        assert not torch.equal(w4, w2)

        restored = c.restore_head("h", "step-2")
        assert restored.weights_version == info.weights_version
        assert restored.optimizer_step == 2
        assert torch.equal(run.weights(), w2)
        # The moments came back too: the same steps give the same W, bit for bit.
        assert [run.step(s) for s in (3, 4)] == losses
        assert torch.equal(run.weights(), w4)
        again = c.get_head("h")
        assert (again.weights_version, again.optimizer_step) == (head4.weights_version, 4)

        c.snapshot_head("h", "step-4")
        assert [s.tag for s in c.list_snapshots("h")] == ["step-2", "step-4"]
        assert [s.optimizer_step for s in c.list_snapshots("h")] == [2, 4]
        c.delete_snapshot("h", "step-2")
        assert [s.tag for s in c.list_snapshots("h")] == ["step-4"]

        assert _code(lambda: c.restore_head("h", "step-2")) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: c.delete_snapshot("h", "step-2")) == grpc.StatusCode.NOT_FOUND
        for tag in (".hidden", "a/b", "x" * 129):
            assert _code(lambda: c.snapshot_head("h", tag)) == grpc.StatusCode.INVALID_ARGUMENT
            assert _code(lambda: c.restore_head("h", tag)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: c.snapshot_head("nope", "t")) == grpc.StatusCode.NOT_FOUND

        # A deleted head keeps its snapshots, and a restore brings it back.
        c.delete_head("h")
        assert [s.tag for s in c.list_snapshots("h")] == ["step-4"]
        assert c.restore_head("h", "step-4").optimizer_step == 4
        assert torch.equal(run.weights(), w4)
