"""A head tied to its model's input embedding, through a CPU server: EmbeddingRows answers W's
rows; EMBEDDING_GRAD micro-batches land in the pulled dW exactly as a float64 scatter-add of the
same rows beside the head's own micro-batches; keys replay and reused keys are ALREADY_EXISTS;
bad input is refused with its code and changes nothing; every placement the CPU server offers,
deferred dW on and off; and a plain-torch tied model trained with its head and embedding on the
server matches the same model with its own tied head."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch
from torch import nn

from _servers import device_count, devices_flag
from losshead import Client, LossheadError, RemoteLMHead
from losshead.embedding import OffloadedEmbedding
from losshead.joint import JointOptimizer

V, D = 37, 16


def _scatter_add64(base: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = base.to(torch.float64).clone()
    out.index_add_(0, ids.reshape(-1).long(), rows.reshape(-1, rows.shape[-1]).to(torch.float64))
    return out


def test_rows_equal_w_rows(client: Client, make_head) -> None:
    w = torch.randn(V, D)
    head = make_head(V, D, w)
    ids = torch.tensor([[3, 0, 36], [3, 5, 3]])
    got = client.embedding_rows(head, ids)
    assert got.rows.dtype == torch.float32
    assert torch.equal(got.rows, w[ids.reshape(-1)])
    assert got.version == client.get_head(head).weights_version
    bf16 = client.embedding_rows(head, ids.int(), dtype=torch.bfloat16)
    assert torch.equal(bf16.rows, w[ids.reshape(-1)].bfloat16())


def test_rows_split_over_messages_read_one_version(server_address: str, make_head) -> None:
    w = torch.randn(V, D)
    head = make_head(V, D, w)
    ids = torch.randint(0, V, (300,))
    with Client(server_address, client_id="small-pieces") as c:
        c.piece_bytes = 64  # 8 ids a request
        got = c.embedding_rows(head, ids)
    assert torch.equal(got.rows, w[ids])


def test_grad_rows_land_as_float64_scatter_add_beside_head_steps(client: Client,
                                                                 make_head) -> None:
    w = torch.randn(V, D)
    head = make_head(V, D, w)
    reference = make_head(V, D, w)
    hidden, targets = torch.randn(12, D), torch.randint(0, V, (12,))
    client.step(head, hidden, targets, reduction="sum", hidden_dtype=torch.float32)
    client.step(reference, hidden, targets, reduction="sum", hidden_dtype=torch.float32)
    ids = torch.tensor([4, 9, 4, 36, 0, 4, 9])  # repeats, unsorted
    de = torch.randn(7, D)
    result = client.embedding_grad(head, ids, de)
    assert result.token_count == 0 and result.grad_hidden is None
    ids2, de2 = torch.randint(0, V, (2, 5)), torch.randn(2, 5, D, dtype=torch.bfloat16)
    client.embedding_grad(head, ids2, de2)
    want = _scatter_add64(client.pull_gradient(reference).grad, ids, de)
    want = _scatter_add64(want, ids2, de2.float())
    got = client.pull_gradient(head, reset=True)
    torch.testing.assert_close(got.grad.double(), want, rtol=2e-6, atol=2e-6)
    assert got.summary.microbatch_count == 3
    assert got.summary.token_count == 12  # the embedding's rows add no tokens


def test_key_replays_and_reused_key_is_already_exists(client: Client, make_head) -> None:
    head = make_head(V, D, torch.randn(V, D))
    ids, de = torch.tensor([1, 2, 1]), torch.randn(3, D)
    seq = client.next_sequence()
    client.embedding_grad(head, ids, de, sequence=seq)
    once = client.pull_gradient(head).grad.clone()
    again = client.embedding_grad(head, ids, de, sequence=seq)
    assert again.replayed
    with pytest.raises(LossheadError) as e:
        client.embedding_grad(head, ids, de + 1, sequence=seq)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    after = client.pull_gradient(head)
    assert torch.equal(after.grad, once)
    assert after.summary.microbatch_count == 1


@pytest.mark.parametrize("bad", ["id_v", "id_negative", "nan", "inf", "rows_vs_ids"])
def test_bad_gradient_is_refused_and_changes_nothing(client: Client, make_head, bad) -> None:
    head = make_head(V, D, torch.randn(V, D))
    client.embedding_grad(head, torch.tensor([1, 2]), torch.randn(2, D))
    before = client.pull_gradient(head)
    ids, de = torch.tensor([3, 4, 5]), torch.randn(3, D)
    if bad == "id_v":
        ids[1] = V
    elif bad == "id_negative":
        ids[0] = -1
    elif bad == "nan":
        de[2, 3] = float("nan")
    elif bad == "inf":
        de[0, 0] = float("inf")
    else:
        de = torch.randn(2, D)
    with pytest.raises(LossheadError) as e:
        client.embedding_grad(head, ids, de)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    after = client.pull_gradient(head)
    assert torch.equal(after.grad, before.grad)
    assert after.summary.microbatch_count == before.summary.microbatch_count


def test_bad_lookup_is_refused(client: Client, make_head) -> None:
    head = make_head(V, D, torch.randn(V, D))
    for ids in (torch.tensor([V]), torch.tensor([-2])):
        with pytest.raises(LossheadError) as e:
            client.embedding_rows(head, ids)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(LossheadError) as e:
        client.embedding_rows(head, torch.tensor([1]), expected_weights_version=99)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(LossheadError) as e:
        client.embedding_rows("no-such-head", torch.tensor([1]))
    assert e.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("stash", ["0", "1MiB"])
@pytest.mark.parametrize("layout", [{}, {"replicas": 2}, {"shards": 3}])
def test_every_placement(servers, stash: str, layout) -> None:
    devices = device_count(3, at_least=max(layout.values(), default=1))
    server = servers.start(devices_flag(devices), f"--grad_stash_bytes={stash.replace('MiB', '')}"
                           if stash == "0" else "--grad_stash_bytes=1048576",
                           "--grad_stash_idle=inf")
    with Client(server.address, client_id="placed") as c:
        w = torch.randn(V, D)
        c.create_head("tied", V, D, weight_dtype=torch.float32, **layout)
        c.create_head("ref", V, D, weight_dtype=torch.float32)
        c.upload_weights("tied", w)
        c.upload_weights("ref", w)
        ids = torch.tensor([36, 0, 12, 12, 25, 36, 1])
        assert torch.equal(c.embedding_rows("tied", ids).rows, w[ids])
        de = torch.randn(7, D)
        for k in range(4):
            h, t = torch.randn(9, D), torch.randint(0, V, (9,))
            c.step("tied", h, t, reduction="sum", hidden_dtype=torch.float32)
            c.step("ref", h, t, reduction="sum", hidden_dtype=torch.float32)
            if k == 1:
                c.embedding_grad("tied", ids, de)
        want = _scatter_add64(c.pull_gradient("ref").grad, ids, de)
        got = c.pull_gradient("tied", reset=True)
        torch.testing.assert_close(got.grad.double(), want, rtol=2e-6, atol=2e-6)
        assert got.summary.microbatch_count == 5


class _TiedLM(nn.Module):
    """embedding -> one layer -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layer = nn.Linear(D, D)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.embed(ids)))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.hidden(ids) @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def test_tied_model_trains_as_its_own_tied_head(client: Client, make_head) -> None:
    torch.manual_seed(5)
    local = _TiedLM()
    offloaded = copy.deepcopy(local)
    head = make_head(V, D, local.embed.weight.detach().clone())
    embed = OffloadedEmbedding(client, head, V, D)
    offloaded.embed = embed  # type: ignore[assignment]
    lm_head = RemoteLMHead(client, head, reduction="mean",
                           wire_dtype=torch.float32, grad_hidden_dtype=torch.float32)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.5)
    opt = JointOptimizer(torch.optim.SGD(offloaded.layer.parameters(), lr=0.5), client, head,
                         local=True)
    local_losses, losses = [], []
    for step in range(4):
        ids = torch.randint(0, V, (3, 8))
        ids[0, :3] = 7  # repeated ids
        targets = torch.randint(0, V, (3, 8))
        local_opt.zero_grad()
        loss = local(ids, targets)
        loss.backward()
        local_opt.step()
        local_losses.append(loss.item())
        opt.zero_grad()
        loss = lm_head(offloaded.hidden(ids), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses), rtol=1e-5,
                               atol=1e-6)
    w = client.download_weights(head).weights
    torch.testing.assert_close(w, local.embed.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(offloaded.layer.weight, local.layer.weight, rtol=1e-5, atol=1e-6)
