"""A head with an output bias (HeadSpec.bias): the loss, dH, dW and db of fresh random
micro-batches against torch float64 autograd of F.linear(h, W, b); db in the gradient window
exactly once (a replay adds nothing, a reset or a discard clears it); the server's AdamW step of
b against torch.optim.AdamW (with and without weight decay on b); W and b pushed, added and
downloaded together; a snapshot round trip that keeps b, db and b's moments; and the refusals,
with their exact codes and nothing changed."""

from __future__ import annotations

from typing import List, Tuple

import grpc
import pytest
import torch
import torch.nn.functional as F

from losshead import Client, LossheadError, LossOptions

V, D = 37, 16


def _code(call) -> grpc.StatusCode:
    with pytest.raises(LossheadError) as e:
        call()
    return e.value.code


def _batch(seed: int, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, D, generator=g)
    targets = torch.randint(0, V, (tokens,), generator=g)
    targets[::4] = -100
    return hidden, targets


def _reference(w: torch.Tensor, b: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
               scale: float = 1.0):
    """Mean cross-entropy of logits = scale (h . w) + b in float64: loss, dH, dW, db."""
    h = hidden.double().clone().requires_grad_(True)
    weight = w.double().clone().requires_grad_(True)
    bias = b.double().clone().requires_grad_(True)
    logits = scale * (h @ weight.T) + bias
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    loss.backward()
    return loss.item(), h.grad, weight.grad, bias.grad


def _new_head(c: Client, name: str, dtype=torch.float32, **kw) -> Tuple[torch.Tensor, torch.Tensor]:
    c.create_head(name, V, D, weight_dtype=dtype, bias=True, **kw)
    g = torch.Generator().manual_seed(hash(name) % 1000)
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).float()
    b = torch.randn(V, generator=g)
    c.push_weights(name, w, bias=b)
    return w, b


@pytest.fixture
def c(server_address: str):
    with Client(server_address, native=False, client_id="bias") as client:
        yield client


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_loss_dh_dw_db_match_float64(c: Client, scale: float) -> None:
    name = f"bias-ref-{scale}"
    w, b = _new_head(c, name, default_options=LossOptions(logit_scale=scale))
    try:
        info = c.get_head(name)
        assert info.spec.bias
        hidden, targets = _batch(1, 48)
        r = c.step(name, hidden, targets, hidden_dtype=torch.float32,
                   grad_hidden_dtype=torch.float32)
        loss, dh, dw, db = _reference(w, b, hidden, targets, scale)
        assert r.loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(r.grad_hidden.double(), dh, rtol=1e-4, atol=1e-6)
        # The window holds the micro-batch's gradients as reduced (the mean's).
        pulled = c.pull_gradient(name, reset=True)
        assert pulled.summary.token_count == int((targets != -100).sum())
        torch.testing.assert_close(pulled.grad.double(), dw, rtol=1e-4, atol=1e-5)
        assert pulled.grad_bias is not None and pulled.grad_bias.shape == (V,)
        torch.testing.assert_close(pulled.grad_bias.double(), db, rtol=1e-4, atol=1e-5)
        # Forward-only: the same loss, nothing in the window.
        e = c.step(name, hidden, targets, hidden_dtype=torch.float32, forward_only=True)
        assert e.loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert torch.count_nonzero(c.pull_gradient(name).grad_bias) == 0
    finally:
        c.delete_head(name)


def test_grad_bias_window_is_exactly_once(c: Client) -> None:
    name = "bias-window"
    w, b = _new_head(c, name)
    try:
        batches = [_batch(10 + i, 24) for i in range(3)]
        for i, (hidden, targets) in enumerate(batches):
            assert not c.step(name, hidden, targets, hidden_dtype=torch.float32,
                              sequence=i + 1).replayed
        # A replay of a counted micro-batch answers from memory and adds nothing.
        hidden, targets = batches[1]
        assert c.step(name, hidden, targets, hidden_dtype=torch.float32, sequence=2).replayed
        expected = torch.zeros(V, dtype=torch.float64)
        for hidden, targets in batches:
            _, _, _, db = _reference(w, b, hidden, targets)
            expected += db
        pulled = c.pull_gradient(name)  # without reset: the window stays
        torch.testing.assert_close(pulled.grad_bias.double(), expected, rtol=1e-4, atol=1e-5)
        # A discard (zero_grad) clears db with dW; later micro-batches land in the next window.
        c.discard_gradient(name)
        assert torch.count_nonzero(c.pull_gradient(name).grad_bias) == 0
        hidden, targets = batches[0]
        c.step(name, hidden, targets, hidden_dtype=torch.float32, sequence=4)
        _, _, _, db = _reference(w, b, hidden, targets)
        first = c.pull_gradient(name, reset=True)
        torch.testing.assert_close(first.grad_bias.double(), db, rtol=1e-4, atol=1e-5)
        # The reset cleared it.
        assert torch.count_nonzero(c.pull_gradient(name).grad_bias) == 0
    finally:
        c.delete_head(name)


@pytest.mark.parametrize("bias_weight_decay", [None, 0.0])
def test_adamw_steps_bias_as_torch(c: Client, bias_weight_decay) -> None:
    name = f"bias-adamw-{bias_weight_decay}"
    w, b = _new_head(c, name)
    try:
        c.set_optimizer(name, "adamw")
        weight = torch.nn.Parameter(w.clone())
        bias = torch.nn.Parameter(b.clone())
        groups = [{"params": [weight]},
                  {"params": [bias], "weight_decay": 0.1 if bias_weight_decay is None
                   else bias_weight_decay}]
        opt = torch.optim.AdamW(groups, lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        for step in range(1, 4):
            hidden, targets = _batch(100 + step, 40)
            _, _, dw, db = _reference(weight.detach(), bias.detach(), hidden, targets)
            c.step(name, hidden, targets, hidden_dtype=torch.float32)
            # The window against float64; torch's AdamW then steps the window itself. Adam's
            # update g / (sqrt(v) + eps) is ill-conditioned where |g| is near eps: fed float64's
            # rounding of dW instead, an element with a tiny gradient once landed 0.24 % of lr
            # away (the head is drawn afresh each run: hash(name) is salted per process).
            window = c.pull_gradient(name)
            torch.testing.assert_close(window.grad, dw.float(), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(window.grad_bias, db.float(), rtol=1e-4, atol=1e-6)
            result = c.apply_optimizer(name, step, lr=0.05, betas=(0.9, 0.99), eps=1e-8,
                                       weight_decay=0.1, bias_weight_decay=bias_weight_decay,
                                       grad_divisor=1.0)
            # The norm covers dW and db (the window as it is: the micro-batch's mean).
            norm = torch.sqrt((dw ** 2).sum() + (db ** 2).sum()).item()
            assert result.head_grad_norm == pytest.approx(norm, rel=1e-4)
            weight.grad, bias.grad = window.grad, window.grad_bias
            opt.step()
        got = c.download_weights(name)
        torch.testing.assert_close(got.weights, weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.bias, bias.detach(), rtol=1e-4, atol=1e-5)
        assert c.get_head(name).optimizer_step == 3
        # The step zeroed db with dW.
        assert torch.count_nonzero(c.pull_gradient(name).grad_bias) == 0
    finally:
        c.delete_head(name)


def test_clipping_covers_the_bias(c: Client) -> None:
    name = "bias-clip"
    w, b = _new_head(c, name)
    try:
        c.set_optimizer(name, "sgd")
        hidden, targets = _batch(7, 32)
        _, _, dw, db = _reference(w, b, hidden, targets)
        c.step(name, hidden, targets, hidden_dtype=torch.float32)
        norm = torch.sqrt((dw ** 2).sum() + (db ** 2).sum()).item()
        result = c.apply_optimizer(name, 1, lr=1.0, max_norm=norm / 4, grad_divisor=1.0)
        assert result.clip_coefficient == pytest.approx(0.25, rel=1e-4)
        got = c.download_weights(name)
        torch.testing.assert_close(got.bias.double(), b.double() - 0.25 * db, rtol=1e-4,
                                   atol=1e-5)
    finally:
        c.delete_head(name)


def test_push_add_and_download_round_trip(c: Client) -> None:
    name = "bias-push"
    c.create_head(name, V, D, weight_dtype=torch.bfloat16, bias=True)
    try:
        # Created with zeros.
        fresh = c.download_weights(name)
        assert torch.count_nonzero(fresh.bias) == 0 and fresh.bias.dtype == torch.bfloat16
        g = torch.Generator().manual_seed(5)
        w = torch.randn(V, D, generator=g).to(torch.bfloat16)
        b = torch.randn(V, generator=g) * 3
        version = c.push_weights(name, w.float(), bias=b)
        got = c.download_weights(name, dtype=torch.float32)
        assert got.version == version
        assert torch.equal(got.weights, w.float())
        assert torch.equal(got.bias, b)  # b is fp32 on the server whatever W's dtype
        assert torch.equal(c.download_weights(name).bias, b.to(torch.bfloat16))
        delta = torch.randn(V, generator=g)
        c.push_weights(name, torch.zeros(V, D), bias=delta, add=True)
        assert torch.equal(c.download_weights(name, dtype=torch.float32).bias, b + delta)
    finally:
        c.delete_head(name)


def test_refusals_change_nothing(c: Client) -> None:
    name = "bias-refusals"
    w, b = _new_head(c, name)
    plain = "bias-none"
    c.create_head(plain, V, D, weight_dtype=torch.float32)
    try:
        version = c.get_head(name).weights_version
        # W alone, a bias of the wrong length, a bias with NaN.
        assert _code(lambda: c.push_weights(name, w)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: c.push_weights(name, w, bias=b[:-1])) == \
            grpc.StatusCode.INVALID_ARGUMENT
        bad = b.clone()
        bad[3] = float("nan")
        assert _code(lambda: c.push_weights(name, w, bias=bad)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert c.get_head(name).weights_version == version
        assert torch.equal(c.download_weights(name).bias, b)
        # A head without a bias takes no bias, and sends none.
        assert _code(lambda: c.push_weights(plain, w, bias=b)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert c.download_weights(plain).bias is None
        assert c.pull_gradient(plain).grad_bias is None
        # A bias weight decay that is no weight decay.
        c.set_optimizer(name, "adamw")
        hidden, targets = _batch(3, 16)
        c.step(name, hidden, targets, hidden_dtype=torch.float32)
        assert _code(lambda: c.apply_optimizer(name, 1, lr=0.1, bias_weight_decay=-1.0)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert c.get_head(name).optimizer_step == 0
        assert c.get_head(name).tokens_since_pull == int((targets != -100).sum())
    finally:
        c.delete_head(name)
        c.delete_head(plain)


def test_snapshot_keeps_bias_gradient_and_moments(servers, tmp_path) -> None:
    server = servers.start(f"--checkpoint_dir={tmp_path / 'ckpt'}", "--checkpoint_interval=0",
                           "--grad_stash_idle=inf")
    with Client(server.address, native=False, client_id="bias-snap") as c:
        _new_head(c, "h")
        c.set_optimizer("h", "adamw")

        def run(steps: List[int]) -> None:
            for s in steps:
                hidden, targets = _batch(200 + s, 32)
                c.step("h", hidden, targets, hidden_dtype=torch.float32)
                c.apply_optimizer("h", s, lr=0.05, weight_decay=0.01)

        run([1, 2])
        hidden, targets = _batch(999, 16)
        c.step("h", hidden, targets, hidden_dtype=torch.float32)
        window = c.pull_gradient("h")  # an open window: db goes into the snapshot too
        c.snapshot_head("h", "s2")
        run([3, 4])
        after = c.download_weights("h")

        restored = c.restore_head("h", "s2")
        assert restored.spec.bias and restored.optimizer_step == 2
        again = c.pull_gradient("h")
        assert torch.equal(again.grad_bias, window.grad_bias)
        assert torch.equal(again.grad, window.grad)
        # b's moments came back with W's: the same steps give the same b, bit for bit.
        run([3, 4])
        final = c.download_weights("h")
        assert torch.equal(final.weights, after.weights)
        assert torch.equal(final.bias, after.bias)
