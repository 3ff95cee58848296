"""losshead.functional.linear_cross_entropy against RemoteLMHead and torch (float64)."""

from __future__ import annotations

import zlib

import pytest
import torch

import losshead.functional as LF
from _reference import assert_close, random_problem, reference
from losshead import Client, RemoteLMHead, StepPlan

FP32_REL = 2e-5


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    {},
    {"ignore_index": 5, "label_smoothing": 0.1},
    {"z_loss": 1e-2, "logit_softcap": 3.0},
], ids=["plain", "ignore5_smooth", "zloss_softcap"])
def test_the_function_equals_the_module(client: Client, make_head, reduction: str,
                                        options: dict) -> None:
    """Same loss, dH and dW from the function as from the module, bit for bit, and both as
    torch's own linear + cross_entropy."""
    n, d, v = 420, 24, 71
    ignore = options.get("ignore_index", -100)
    hidden, weight, targets = random_problem(n, d, v, seed=_seed(reduction, options),
                                             ignore_index=ignore, ignore_fraction=0.2)
    plan = StepPlan(streams=2, chunk_tokens=128, min_chunk_tokens=64, depth=2,
                    wire_dtype=torch.float32)
    upstream = torch.rand(n) + 0.5 if reduction == "none" else torch.tensor(0.75)
    got = []
    for kind in ("module", "function"):
        name = make_head(v, d, weights=weight)
        h = hidden.clone().reshape(6, 70, d).requires_grad_()
        t = targets.reshape(6, 70)
        if kind == "module":
            loss = RemoteLMHead(client, name, reduction=reduction, plan=plan, **options)(h, t)
        else:
            loss = LF.linear_cross_entropy(h, t, client=client, head=name, reduction=reduction,
                                           plan=plan, **options)
        loss.backward(upstream.reshape(6, 70) if reduction == "none" else upstream)
        got.append((loss.detach(), h.grad.reshape(n, d),
                    client.pull_gradient(name, reset=True).grad))
    (lm, dhm, dwm), (lf, dhf, dwf) = got
    assert lm.shape == lf.shape and lm.dtype == lf.dtype
    # Each micro-batch's loss and dH are its own: bit for bit. dW adds the micro-batches up in
    # an order the server's timing decides: equal up to rounding.
    assert torch.equal(lm, lf) and torch.equal(dhm, dhf)
    assert_close(dwf, dwm, FP32_REL, "dW, function against module")
    ref = reference(hidden, weight, targets, reduction=reduction, upstream=upstream, **options)
    assert_close(lf.reshape(ref.loss.shape), ref.loss, FP32_REL, "loss")
    assert_close(dhf, ref.grad_hidden, FP32_REL, "dH x upstream")
    summed = reference(hidden, weight, targets, reduction="sum", **options)
    assert_close(dwf, summed.grad_weight, FP32_REL, "dW (token sum)")


def test_training_false_and_no_grad_add_nothing(client: Client, make_head) -> None:
    n, d, v = 200, 16, 40
    hidden, weight, targets = random_problem(n, d, v, seed=91, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    plan = StepPlan(wire_dtype=torch.float32, chunk_tokens=64)
    ref = reference(hidden, weight, targets)
    h = hidden.clone().requires_grad_()
    loss, result = LF.linear_cross_entropy(h, targets, client=client, head=name, plan=plan,
                                           training=False, return_result=True)
    loss.backward()
    assert result.forward_only and result.token_count == ref.token_count
    assert_close(loss, ref.loss, FP32_REL, "loss")
    assert_close(h.grad, ref.grad_hidden, FP32_REL, "dH of a frozen head")
    with torch.no_grad():
        evaluated = LF.linear_cross_entropy(hidden, targets, client=client, head=name,
                                            plan=plan)
    assert evaluated.grad_fn is None
    assert float(evaluated) == float(loss)
    info = client.get_head(name)
    assert (info.tokens_since_pull, info.microbatches_since_pull) == (0, 0)


def test_a_training_call_adds_to_the_window_and_is_noted(client: Client, make_head) -> None:
    n, d, v = 150, 16, 40
    hidden, weight, targets = random_problem(n, d, v, seed=92, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    window = RemoteLMHead(client, name).window
    before = window.pending
    loss, result = LF.linear_cross_entropy(hidden.clone().requires_grad_(), targets,
                                           client=client, head=name, reduction="sum",
                                           plan=StepPlan(wire_dtype=torch.float32),
                                           return_result=True)
    assert not result.forward_only
    assert window.pending == before + 1
    assert client.get_head(name).tokens_since_pull == result.token_count
    assert float(loss) == pytest.approx(result.loss_sum)


def test_bad_reduction_is_refused_before_anything_is_sent(client: Client, make_head) -> None:
    name = make_head(10, 4)
    with pytest.raises(ValueError, match="reduction"):
        LF.linear_cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long),
                                client=client, head=name, reduction="avg")
    assert client.get_head(name).microbatches_since_pull == 0
