"""RemoteLMHead and RemoteHeadOptimizer against torch's own linear + cross_entropy (float64)."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch
import torch.nn.functional as F

from _reference import assert_close, random_problem, reference
from _servers import CUDA_BF16_ROUNDING_REL, on_cuda
from losshead import Client, RemoteHeadOptimizer, RemoteLMHead

FP32_REL = 2e-5
BF16_REL = 2 ** -7  # dH travels back in bf16: one rounding of 8 mantissa bits, with headroom


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    {},
    {"ignore_index": -100},
    {"ignore_index": 7, "label_smoothing": 0.2},
    {"z_loss": 1e-2, "logit_softcap": 2.5},
], ids=["plain", "ignore", "ignore7_smooth", "zloss_softcap"])
def test_remote_head_matches_torch(client: Client, make_head, reduction: str,
                                   options: dict) -> None:
    n, d, v = 80, 32, 97
    ignore = options.get("ignore_index", -100)
    hidden, weight, targets = random_problem(
        n, d, v, seed=_seed(reduction, options), ignore_index=ignore,
        ignore_fraction=0.25 if "ignore_index" in options else 0.0)
    name = make_head(v, d, weights=weight)
    head = RemoteLMHead(client, name, reduction=reduction, wire_dtype=torch.float32, **options)
    mirror = RemoteHeadOptimizer(client, name)
    h = hidden.clone().requires_grad_()
    loss = head(h, targets)
    # A non-trivial upstream gradient: dH must be scaled by it locally.
    upstream = torch.rand(n) + 0.5 if reduction == "none" else torch.tensor(0.75)
    loss.backward(upstream)
    ref = reference(hidden, weight, targets, reduction=reduction, upstream=upstream, **options)
    assert loss.shape == ref.loss.shape
    assert_close(loss, ref.loss, FP32_REL, "loss")
    assert_close(h.grad, ref.grad_hidden, FP32_REL, "dH x upstream")
    # dW is the token mean of the unscaled loss, whatever the reduction and upstream gradient.
    mean_ref = reference(hidden, weight, targets, reduction="mean", **options)
    summary = mirror.pull_gradient()
    assert summary.token_count == ref.token_count
    assert_close(mirror.weight.grad, mean_ref.grad_weight, FP32_REL, "dW (token mean)")


def test_remote_head_bf16_wire(client: Client, make_head) -> None:
    n, d, v = 64, 48, 120
    hidden, weight, targets = random_problem(n, d, v, seed=21, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight, dtype=torch.bfloat16)
    head = RemoteLMHead(client, name)  # bf16 on the wire, bf16 head
    h = hidden.clone().requires_grad_()
    loss = head(h, targets)
    loss.backward()
    ref = reference(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), targets)
    assert_close(loss, ref.loss, 1e-4, "loss")
    assert h.grad.dtype == torch.float32
    assert_close(h.grad, ref.grad_hidden, BF16_REL, "dH")
    grad = client.pull_gradient(name).grad / ref.token_count
    # A CUDA server forms the softmax gradient in bf16 before the dW GEMM.
    assert_close(grad, ref.grad_weight, CUDA_BF16_ROUNDING_REL if on_cuda() else 1e-4, "dW")


def test_pipelined_chunks_equal_one_batch(client: Client, make_head) -> None:
    n, d, v = 700, 24, 50
    hidden, weight, targets = random_problem(n, d, v, seed=22, ignore_fraction=0.3)
    name = make_head(v, d, weights=weight)
    head = RemoteLMHead(client, name, wire_dtype=torch.float32, chunk_tokens=64, streams=3)
    h = hidden.clone().reshape(7, 100, d).requires_grad_()  # (batch, seq, D) like a trunk's
    loss = head(h, targets.reshape(7, 100))
    loss.backward()
    ref = reference(hidden, weight, targets)
    assert head.last_result is not None and head.last_result.token_count == ref.token_count
    assert_close(loss, ref.loss, FP32_REL, "loss")
    assert_close(h.grad.reshape(n, d), ref.grad_hidden, FP32_REL, "dH")
    info = client.get_head(name)
    assert info.microbatches_since_pull == 11  # ceil(700 / 64) chunks, each a micro-batch
    assert_close(client.pull_gradient(name).grad / ref.token_count, ref.grad_weight, FP32_REL,
                 "dW")


def test_gradient_accumulation_global_token_mean(client: Client, make_head) -> None:
    """Micro-batches of different sizes and ignore ratios = one batch with the mean loss."""
    d, v = 16, 40
    sizes, ignore = [30, 55, 12, 41], [0.0, 0.5, 0.2, 0.7]
    parts = [random_problem(s, d, v, seed=30 + i, ignore_fraction=f)
             for i, (s, f) in enumerate(zip(sizes, ignore))]
    weight = parts[0][1]
    name = make_head(v, d, weights=weight)
    head = RemoteLMHead(client, name, reduction="sum", wire_dtype=torch.float32)
    mirror = RemoteHeadOptimizer(client, name)
    leaves = []
    for hidden, _, targets in parts:
        h = hidden.clone().requires_grad_()
        head(h, targets).backward()
        leaves.append(h)
    summary = mirror.pull_gradient()
    total = torch.cat([t for _, _, t in parts])
    all_hidden = torch.cat([h for h, _, _ in parts])
    ref = reference(all_hidden, weight, total, reduction="mean")
    assert summary.token_count == ref.token_count == head.take_token_count()
    assert summary.microbatch_count == len(parts)
    assert_close(mirror.weight.grad, ref.grad_weight, FP32_REL, "dW")
    # The trunk's share: summed dH divided by the global token count.
    got = torch.cat([h.grad for h in leaves]) / summary.token_count
    assert_close(got, ref.grad_hidden, FP32_REL, "dH / global tokens")


def test_data_parallel_ranks_share_one_gradient(server_address: str, client: Client,
                                                make_head) -> None:
    """Two ranks (own clients, own streams) step into one head; one pull covers both."""
    d, v = 16, 33
    shards = [random_problem(n, d, v, seed=40 + r, ignore_fraction=0.3)
              for r, n in enumerate([48, 29])]
    weight = shards[0][1]
    name = make_head(v, d, weights=weight)
    mirror = RemoteHeadOptimizer(client, name)
    counts = [0, 0]
    errors = []

    def rank(r: int) -> None:
        try:
            with Client(server_address, client_id=f"rank{r}") as c:
                head = RemoteLMHead(c, name, reduction="sum", wire_dtype=torch.float32,
                                    chunk_tokens=16)
                hidden, _, targets = shards[r]
                for half in (slice(0, len(targets) // 2), slice(len(targets) // 2, None)):
                    head(hidden[half].clone().requires_grad_(), targets[half]).backward()
                counts[r] = head.take_token_count()
        except Exception as e:  # surfaced below; a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    summary = mirror.pull_gradient()
    ref = reference(torch.cat([s[0] for s in shards]), weight,
                    torch.cat([s[2] for s in shards]), reduction="mean")
    assert summary.token_count == sum(counts) == ref.token_count
    assert_close(mirror.weight.grad, ref.grad_weight, FP32_REL, "dW over both ranks")


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["sgd_momentum", "adamw"])
def test_optimizer_bridge_tracks_a_local_head(client: Client, make_head, make_optimizer) -> None:
    """Several steps of accumulation + optimizer: remote W follows a local torch head."""
    d, v = 24, 45
    name = make_head(v, d, init_std=0.2, seed=5)
    mirror = RemoteHeadOptimizer(client, name)
    opt = make_optimizer([mirror.weight])
    head = RemoteLMHead(client, name, wire_dtype=torch.float32, label_smoothing=0.05)
    local_w = torch.nn.Parameter(client.download_weights(name, dtype=torch.float32).weights)
    local_opt = make_optimizer([local_w])
    for step in range(4):
        micro = [random_problem(20 + 5 * k, d, v, seed=100 * step + k, ignore_fraction=0.2)
                 for k in range(3)]
        for hidden, _, targets in micro:
            head(hidden.requires_grad_(), targets).backward()
        summary = mirror.step(opt)
        assert summary.microbatch_count == 3 and summary.max_weights_version == step + 1
        all_h = torch.cat([m[0].detach() for m in micro])
        all_t = torch.cat([m[2] for m in micro])
        loss = F.cross_entropy(F.linear(all_h, local_w), all_t, label_smoothing=0.05)
        local_opt.zero_grad()
        loss.backward()
        local_opt.step()
        assert mirror.version == step + 2
    assert_close(mirror.weight, local_w, 1e-4, "mirror W")
    assert_close(client.download_weights(name).weights, local_w, 1e-4, "server W")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_grad_evaluates_without_touching_dw(client: Client, make_head, reduction: str) -> None:
    n, d, v = 40, 16, 30
    hidden, weight, targets = random_problem(n, d, v, seed=_seed("eval", reduction),
                                             ignore_fraction=0.2)
    name = make_head(v, d, weights=weight)
    head = RemoteLMHead(client, name, reduction=reduction, wire_dtype=torch.float32,
                        z_loss=1e-3, chunk_tokens=16)
    # A gradient window with something in it: evaluation must leave it exactly as it is.
    train = hidden[:25].clone().requires_grad_()
    head(train, targets[:25]).sum().backward()
    counted = head.take_token_count()
    before = client.pull_gradient(name)
    info_before = client.get_head(name)

    with torch.no_grad():
        loss = head(hidden, targets)
    explicit = head.evaluate(hidden, targets)
    ref = reference(hidden, weight, targets, reduction=reduction, z_loss=1e-3)
    assert loss.shape == ref.loss.shape and not loss.requires_grad
    assert_close(loss, ref.loss, FP32_REL, "eval loss")
    assert torch.equal(explicit, loss)
    assert head.last_result is not None and head.last_result.forward_only
    assert head.last_result.grad_hidden is None  # no dH asked for, none sent

    after = client.pull_gradient(name)
    info = client.get_head(name)
    assert torch.equal(after.grad, before.grad)
    assert after.summary == before.summary
    assert after.summary.token_count == counted
    assert (info.tokens_since_pull, info.microbatches_since_pull, info.tokens_total,
            info.microbatches_total) == (info_before.tokens_since_pull,
                                         info_before.microbatches_since_pull,
                                         info_before.tokens_total, info_before.microbatches_total)
    assert head.take_token_count() == 0


def test_evaluation_follows_pushed_weights(client: Client, make_head) -> None:
    n, d, v = 32, 16, 24
    hidden, weight, targets = random_problem(n, d, v, seed=51)
    name = make_head(v, d, weights=weight)
    head = RemoteLMHead(client, name, wire_dtype=torch.float32)
    with torch.no_grad():
        first = head(hidden, targets)
    new_w = weight * 0.5 + 0.1
    client.push_weights(name, new_w)
    with torch.no_grad():
        second = head(hidden, targets)
    assert_close(first, reference(hidden, weight, targets).loss, FP32_REL, "loss, first W")
    assert_close(second, reference(hidden, new_w, targets).loss, FP32_REL, "loss, pushed W")
    assert head.last_result is not None
    assert head.last_result.weights_version == client.get_head(name).weights_version
