"""losshead.integrations: a causal LM's head offloaded in one call, against the same model with its
own head (Hugging Face's label shift and loss) on fresh random inputs.

The first part needs no model library: a hand-written model with the layout of Hugging Face's
*ForCausalLM classes (`.model` trunk returning hidden states, `.lm_head`, `.config`). The tests
marked by `pytest.importorskip("transformers")` build tiny Llama and Gemma 2 models from configs
and run where transformers is installed.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools
import re
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator, List, Optional

import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _reference import assert_close
from _servers import CUDA_TF32_REL, device_count, devices_flag, on_cuda
from losshead import Client, LossheadError, RemoteAdamW, StepPlan
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead.embedding import OffloadedEmbedding
from losshead.integrations.causal_lm import (TIED_EMBEDDINGS_ERROR, CausalLMOutput,
                                             OffloadedLMHead, causal_targets, offload_causal_lm,
                                             reduce_loss)

V, D, B, T = 97, 32, 3, 11
FP32_REL = 2e-5
BF16_REL = 2 ** -6  # hidden states go up and dH comes back in bf16, then through the trunk


# -- a model of Hugging Face's layout, without Hugging Face --------------------------------------
@dataclass
class TrunkOutput:
    last_hidden_state: torch.Tensor


class TinyTrunk(nn.Module):
    """Embeddings, one causal mixing layer (each position sees the mean of itself and the ones
    before it) and a final norm; remembers the keyword arguments of its last call."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.last_kwargs: dict = {}

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs: object) -> TrunkOutput:
        self.last_kwargs = dict(kwargs)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device).reshape(1, -1, 1)
        x = x + torch.tanh(self.mix(x.cumsum(1) / steps))
        return TrunkOutput(self.norm(x))


class TinyCausalLM(nn.Module):
    """Its own forward is the reference: logits, Gemma's soft-cap, then Hugging Face's loss
    (slice the logits, shift the labels, cross-entropy with ignore index -100, divided by
    num_items_in_batch when given)."""

    def __init__(self, vocab: int = V, hidden: int = D, *, tie: bool = False,
                 softcap: Optional[float] = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden,
                                      tie_word_embeddings=tie, final_logit_softcapping=softcap)
        self.model = TinyTrunk(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.3)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, num_items_in_batch: object = None
                ) -> SimpleNamespace:
        hidden = self.model(input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
            shift_labels = labels[..., 1:].reshape(-1)
            reduction = "sum" if num_items_in_batch is not None else "mean"
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100,
                                   reduction=reduction)
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        return SimpleNamespace(loss=loss, logits=logits)


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode()) % 10_000


def _batch(seed: int, vocab: int = V, ignore_fraction: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(B, T, generator=g) < ignore_fraction] = -100
    mask = torch.ones(B, T, dtype=torch.long)
    return input_ids, mask, labels


def _step_both(model: nn.Module, reference: nn.Module, batch, rel: float, **extra: object):
    """One forward and backward of the offloaded model and of its reference on `batch`
    (input_ids, mask, labels): their losses and every trunk gradient agree within `rel`.
    Returns both outputs."""
    input_ids, mask, labels = batch
    out = model(input_ids, attention_mask=mask, labels=labels, **extra)
    out.loss.backward()
    want = reference(input_ids, attention_mask=mask, labels=labels, **extra)
    want.loss.backward()
    assert_close(out.loss, want.loss, rel, "loss")
    for (n, p), (_, q) in zip(sorted(model.model.named_parameters()),
                              sorted(reference.model.named_parameters())):
        assert_close(p.grad, q.grad, rel, f"trunk gradient {n}")
    return out, want


_names = itertools.count()


@pytest.fixture
def head_name(client: Client, request: pytest.FixtureRequest) -> Iterator[Callable[[], str]]:
    """head_name() -> a fresh head name; heads of those names are deleted when the test ends."""
    made: List[str] = []

    def make() -> str:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"hf{next(_names)}-{request.node.name}")[:120]
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            client.delete_head(name)
        except LossheadError:
            pass


def _assert_no_head(client: Client, name: str) -> None:
    with pytest.raises(LossheadError) as e:
        client.get_head(name)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def _assert_untouched(model: TinyCausalLM, weight: torch.Tensor) -> None:
    assert isinstance(model.lm_head, nn.Linear)
    assert "forward" not in model.__dict__
    assert torch.equal(model.lm_head.weight.detach(), weight)


# -- the pure parts ------------------------------------------------------------------------------
def test_causal_targets_give_hugging_faces_loss() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    _, _, labels = _batch(2)
    targets = causal_targets(labels)
    assert torch.equal(targets[..., :-1], labels[..., 1:])
    assert bool((targets[..., -1] == -100).all())
    # Every position against its shifted target = Hugging Face's slice of the logits.
    ours = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum")
    theirs = F.cross_entropy(logits[..., :-1, :].reshape(-1, V), labels[..., 1:].reshape(-1),
                             reduction="sum")
    assert_close(ours, theirs, 1e-12, "summed loss")
    assert int((targets != -100).sum()) == int((labels[..., 1:] != -100).sum())
    assert torch.equal(causal_targets(labels, ignore_index=5)[..., -1], torch.full((B,), 5))


def test_reduce_loss_mean_num_items_and_all_ignored() -> None:
    s = torch.tensor(12.0, requires_grad=True)
    assert reduce_loss(s, 4).detach().item() == 3.0
    assert reduce_loss(s, 4, num_items_in_batch=8).detach().item() == 1.5
    assert reduce_loss(s, 4, num_items_in_batch=torch.tensor(6)).detach().item() == 2.0
    empty = torch.tensor(0.0, requires_grad=True)
    loss = reduce_loss(empty, 0)
    assert torch.isnan(loss)
    loss.backward()
    assert float(empty.grad) == 1.0  # dH of no tokens is zero, so the trunk's gradient is too


# -- offloading the hand-written model -----------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["mean", "num_items", "softcap", "num_items_tensor"])
def test_remote_loss_and_trunk_gradients_match_own_head(client: Client, head_name,
                                                        precision: str, case: str) -> None:
    softcap = 2.0 if case == "softcap" else None
    model = TinyCausalLM(softcap=softcap, seed=_seed(precision, case))
    if precision == "bf16":
        # W must be what a bf16 head holds, so that the comparison sees the wire alone.
        model.lm_head.weight.data = model.lm_head.weight.data.bfloat16().float()
    reference = copy.deepcopy(model).double()
    input_ids, mask, labels = _batch(_seed(precision, case, "batch"))
    kept = int((labels[..., 1:] != -100).sum())
    extra = {}
    if case == "num_items":
        extra["num_items_in_batch"] = kept + 17  # as if other micro-batches shared the step
    elif case == "num_items_tensor":
        extra["num_items_in_batch"] = torch.tensor(2 * kept)
    name = head_name()
    wire = torch.float32 if precision == "fp32" else torch.bfloat16
    rel = FP32_REL if precision == "fp32" else BF16_REL
    offload_causal_lm(model, client, name, head_dtype=wire, wire_dtype=wire, chunk_tokens=8,
                      streams=2)

    out, want = _step_both(model, reference, (input_ids, mask, labels), rel, **extra)
    assert isinstance(out, CausalLMOutput) and out.logits is None
    assert out.loss.dtype == torch.float32
    # The trunk saw the caller's arguments and nothing of the loss's.
    assert set(model.model.last_kwargs) == {"attention_mask"}
    # dW on the server is the gradient of the token sum: the reference's times its divisor.
    divisor = extra.get("num_items_in_batch", kept)
    grad = client.pull_gradient(name).grad
    assert_close(grad, reference.lm_head.weight.grad * float(divisor), rel, "dW")
    assert client.get_head(name).tokens_since_pull == kept
    if softcap:
        # The cap matters at this scale: without it the loss is another one.
        plain = copy.deepcopy(reference)
        plain.config.final_logit_softcapping = None
        uncapped = plain(input_ids, labels=labels, **extra).loss.detach().item()
        assert abs(uncapped - want.loss.detach().item()) > 0.05


def test_weights_upload_exact_and_local_copy_freed(client: Client, head_name) -> None:
    model = TinyCausalLM(seed=3)
    weight = model.lm_head.weight
    original = weight.detach().clone()
    name = head_name()
    offloaded = offload_causal_lm(model, client, name)
    downloaded = client.download_weights(name)
    assert downloaded.weights.dtype == torch.float32
    assert torch.equal(downloaded.weights, original)
    assert downloaded.version == offloaded.weights_version == 2  # created, then pushed once
    # No V x D tensor is left on the trainer, nor any parameter an optimizer would take.
    assert weight.numel() == 0
    assert isinstance(model.lm_head, OffloadedLMHead)
    assert all("lm_head" not in n for n, _ in model.named_parameters())
    assert all(not k.startswith("lm_head") for k in model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in model.model.parameters())
    assert model.lm_head.weight.device.type == "meta" and model.lm_head.weight.numel() == 0
    with pytest.raises(RuntimeError, match=re.escape(f"lm_head lives on the losshead server "
                                                     f"({client.target}, head {name!r})")):
        model.lm_head(torch.zeros(1, D))


def _train_tied(model: nn.Module, steps: int, optimizer: torch.optim.Optimizer) -> List[float]:
    losses = []
    for k in range(steps):
        input_ids, mask, labels = _batch(_seed("tied", k))
        input_ids[0, :4] = 5  # repeated ids in one batch
        optimizer.zero_grad()
        loss = model(input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses


@pytest.mark.parametrize("how", ["config", "by_hand"])
def test_tied_model_offloaded_whole_trains_as_its_own_tied_head(client: Client, head_name,
                                                               how: str) -> None:
    model = TinyCausalLM(tie=True, seed=3) if how == "config" else _tied_by_hand()
    reference = copy.deepcopy(model)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    embedding = model.model.embed_tokens
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    assert offloaded.tied
    assert client.get_head(name).weights_version == 2  # created, then W uploaded once
    assert isinstance(model.model.embed_tokens, OffloadedEmbedding)
    assert not any(k.startswith("lm_head") or "embed_tokens" in k for k in model.state_dict())
    assert embedding.weight.numel() == 0  # the tied parameter holds nothing locally
    trunk = [p for p in model.parameters() if p.numel()]
    opt = offloaded.optimizer(torch.optim.SGD(trunk, lr=0.5), kind="sgd")
    losses = _train_tied(model, 4, opt)
    want = _train_tied(reference, 4, torch.optim.SGD(reference.parameters(), lr=0.5))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    w = client.download_weights(name).weights
    torch.testing.assert_close(w, reference.lm_head.weight.detach(), rtol=1e-5, atol=1e-6)

    assert offloaded.weight_keys() == ["model.embed_tokens.weight"]
    exported = offloaded.export_state_dict()
    assert list(exported) == ["model.embed_tokens.weight"]
    assert torch.equal(exported["model.embed_tokens.weight"], w)
    offloaded.restore(model)
    assert model.model.embed_tokens is embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert torch.equal(model.lm_head.weight.detach(), w)


def test_tied_state_dict_load_uploads_once(client: Client, head_name) -> None:
    model = TinyCausalLM(tie=True, seed=4)
    name = head_name()
    offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    new = torch.randn(V, D)
    # A tied checkpoint holds W under the embedding's key, or under both (one tensor).
    model.load_state_dict({**model.state_dict(), "model.embed_tokens.weight": new})
    got = client.get_head(name)
    assert torch.equal(client.download_weights(name).weights, new)
    newer = torch.randn(V, D)
    model.load_state_dict({**model.state_dict(), "model.embed_tokens.weight": newer,
                           "lm_head.weight": newer})
    assert client.get_head(name).weights_version == got.weights_version + 1
    assert torch.equal(client.download_weights(name).weights, newer)


def test_tie_the_head_cannot_serve_refused_and_nothing_changed(client: Client,
                                                              head_name) -> None:
    name = head_name()
    model = TinyCausalLM(tie=False)
    model.config.tie_word_embeddings = True  # but the embedding holds another matrix
    weight = model.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match="^losshead: the model ties its LM head"):
        offload_causal_lm(model, client, name)
    _assert_untouched(model, weight)
    _assert_no_head(client, name)
    assert "{found}" in TIED_EMBEDDINGS_ERROR


def _tied_by_hand() -> TinyCausalLM:
    """Shares the matrix without saying so in the config."""
    model = TinyCausalLM(tie=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def test_other_layouts_and_bad_logit_scales_refused(client: Client, head_name) -> None:
    # A model's logit scale is the head's default (test_loss_terms.py); one that is no scale is
    # refused before anything is sent.
    name = head_name()
    scaled = TinyCausalLM()
    scaled.config.logit_scale = -0.0625
    with pytest.raises(ValueError, match=r"^losshead: config\.logit_scale = -0\.0625 is not"):
        offload_causal_lm(scaled, client, name)
    # (An lm_head with a bias is offloaded with it: test_integrations_bias.py.)
    headless = TinyCausalLM()
    del headless.lm_head
    with pytest.raises(TypeError, match="^losshead: TinyCausalLM is not a causal LM of the "
                                        "expected layout"):
        offload_causal_lm(headless, client, name)
    _assert_no_head(client, name)


def test_attach_to_existing_head(client: Client, head_name) -> None:
    name = head_name()
    trained = torch.randn(V, D, generator=torch.Generator().manual_seed(4)) * 0.2
    client.create_head(name, V, D, weight_dtype=torch.float32)
    version = client.push_weights(name, trained)
    model = TinyCausalLM(seed=5)
    reference = copy.deepcopy(model).double()
    reference.lm_head.weight.data = trained.double()
    offloaded = offload_causal_lm(model, client, name, create=False, wire_dtype=torch.float32)
    assert offloaded.weights_version == version
    assert client.get_head(name).weights_version == version  # nothing uploaded
    input_ids, _, labels = _batch(6)
    assert_close(model(input_ids, labels=labels).loss, reference(input_ids, labels=labels).loss,
                 FP32_REL, "loss on the server's weights")


def test_attach_shape_mismatch_and_create_existing_refused(client: Client, head_name) -> None:
    name = head_name()
    client.create_head(name, V + 1, D)
    model = TinyCausalLM()
    weight = model.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match=re.escape(
            f"losshead: head {name!r} is {V + 1} x {D}, the model's lm_head {V} x {D}")):
        offload_causal_lm(model, client, name, create=False)
    _assert_untouched(model, weight)
    with pytest.raises(LossheadError) as e:
        offload_causal_lm(model, client, name)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    _assert_untouched(model, weight)
    assert client.get_head(name).spec.vocab_size == V + 1  # the existing head is left alone


def test_calls_without_labels_or_for_logits_raise(client: Client, head_name) -> None:
    model = TinyCausalLM()
    name = head_name()
    offload_causal_lm(model, client, name)
    input_ids, _, labels = _batch(7)
    with pytest.raises(ValueError, match=re.escape(
            f"losshead: the LM head is offloaded to {client.target} (head {name!r}): the "
            "model's forward computes the loss only and needs labels")):
        model(input_ids)
    with pytest.raises(ValueError, match=re.escape("losshead: logits_to_keep=1 asks for logits")):
        model(input_ids, labels=labels, logits_to_keep=1)
    with pytest.raises(ValueError, match="^losshead: labels of shape"):
        model(input_ids, labels=labels[:, :-1])
    assert client.get_head(name).tokens_total == 0  # nothing reached the server
    with pytest.raises(ValueError, match="offloaded already"):
        offload_causal_lm(model, client, head_name())


def test_no_grad_evaluates_and_tuple_output(client: Client, head_name) -> None:
    model = TinyCausalLM(seed=8)
    reference = copy.deepcopy(model).double()
    name = head_name()
    offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    input_ids, _, labels = _batch(9)
    with torch.no_grad():
        loss = model(input_ids, labels=labels).loss
    assert client.get_head(name).tokens_since_pull == 0  # forward-only: dW untouched
    assert_close(loss, reference(input_ids, labels=labels).loss, FP32_REL, "eval loss")
    as_tuple = model(input_ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 1
    assert_close(as_tuple[0], loss, FP32_REL, "tuple loss")


def test_training_with_server_optimizer_then_export_and_restore(client: Client,
                                                                head_name) -> None:
    model = TinyCausalLM(seed=10)
    weight = model.lm_head.weight
    original = weight.detach().clone()
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    trunk_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    head_opt = RemoteAdamW(client, name, lr=1e-2)
    losses = []
    input_ids, _, labels = _batch(100)
    for _ in range(4):  # the same batch: its loss must go down
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        trunk_opt.step()
        head_opt.step()
        trunk_opt.zero_grad()
        losses.append(loss.detach().item())
    assert losses[-1] < losses[0]
    on_server = client.download_weights(name)
    exported = offloaded.export_state_dict()
    assert list(exported) == ["lm_head.weight"]
    assert torch.equal(exported["lm_head.weight"], on_server.weights)
    assert not torch.equal(on_server.weights, original)  # the head did train

    version = offloaded.restore(model)
    assert version == on_server.version == client.get_head(name).weights_version
    assert model.lm_head.weight is weight  # the model's own parameter, refilled
    assert torch.equal(weight.detach(), on_server.weights)
    assert "forward" not in model.__dict__
    assert torch.equal(model.state_dict()["lm_head.weight"], on_server.weights)
    input_ids, _, labels = _batch(11)
    out = model(input_ids, labels=labels)  # the model's own forward again: logits are back
    hidden = model.model(input_ids).last_hidden_state
    assert torch.equal(out.logits, model.lm_head(hidden))
    with pytest.raises(ValueError, match="is not offloaded from this model"):
        offloaded.restore(model)


def test_local_head_block_then_offloaded_again(client: Client, head_name) -> None:
    model = TinyCausalLM(seed=12)
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    input_ids, _, labels = _batch(13)
    before = model(input_ids, labels=labels).loss.detach().item()
    server_w = client.download_weights(name).weights
    with offloaded.local_head(model) as local:
        assert local is model
        logits = model(input_ids).logits
        hidden = model.model(input_ids).last_hidden_state
        assert torch.equal(logits, F.linear(hidden, server_w))
        model.lm_head.weight.data.zero_()  # discarded: the server's W is the trained one
    assert isinstance(model.lm_head, OffloadedLMHead) and offloaded.remote is not None
    assert model.lm_head.weight.numel() == 0
    again = model(input_ids, labels=labels).loss.detach().item()
    assert abs(again - before) <= FP32_REL * abs(before)
    assert torch.equal(client.download_weights(name).weights, server_w)


# -- evaluation: predictions for compute_metrics -------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eval_predictions_are_the_argmax_of_the_own_logits(client: Client, head_name,
                                                           precision: str) -> None:
    """With eval_predictions, an eval-mode forward returns the ids the head predicts (what
    preprocess_logits_for_metrics makes of the logits: argmax(-1)), -1 where the shifted label
    is ignored, with the model's own loss, and counts the correct ones; training forwards and
    the gradient window are unchanged by it."""
    model = TinyCausalLM(seed=_seed("eval", precision))
    wire = torch.float32 if precision == "fp32" else torch.bfloat16
    if precision == "bf16":
        model.lm_head.weight.data = model.lm_head.weight.data.bfloat16().float()
    reference = copy.deepcopy(model).double()
    input_ids, mask, labels = _batch(_seed("eval-batch", precision))
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, head_dtype=wire, wire_dtype=wire,
                                  chunk_tokens=8, streams=2, eval_predictions=True)
    model.eval()
    reference.eval()
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask, labels=labels)
        want = reference(input_ids, attention_mask=mask, labels=labels)
        hidden = model.model(input_ids, attention_mask=mask).last_hidden_state
    rel = FP32_REL if precision == "fp32" else BF16_REL
    assert_close(out.loss, want.loss, rel, "loss")
    targets = causal_targets(labels)
    kept = targets != -100
    assert out.logits.shape == (B, T) and out.logits.dtype == torch.int64
    assert torch.equal(out.logits[~kept], torch.full_like(out.logits[~kept], -1))
    # The head's own argmax on the hidden states the server saw (those of the trunk, in the
    # wire dtype), in float64; a different pick only between logits fp32 cannot tell apart.
    w = client.download_weights(name).weights.double()
    logits = hidden.to(wire).double() @ w.T
    own = logits.argmax(-1)
    differ = kept & (out.logits != own)
    for b, t in torch.nonzero(differ).tolist():
        z = logits[b, t]
        assert float(z.max() - z[out.logits[b, t]]) <= 1e-5 * float(z.abs().max())
    correct = int((kept & (out.logits == targets)).sum())
    assert offloaded.take_eval_accuracy() == (correct, int(kept.sum()))
    assert offloaded.take_eval_accuracy() == (0, 0)
    assert client.get_head(name).microbatches_total == 0  # evaluation counts nothing

    # Training: logits stay None, nothing asked, the step counted as before.
    model.train()
    out = model(input_ids, attention_mask=mask, labels=labels)
    assert out.logits is None and model.lm_head is not None
    assert offloaded.remote.last_result.outputs is None
    assert offloaded.take_eval_accuracy() == (0, 0)
    assert client.get_head(name).tokens_since_pull == int(kept.sum())


def test_eval_predictions_off_returns_no_logits_in_eval(client: Client, head_name) -> None:
    model = TinyCausalLM(seed=3)
    input_ids, mask, labels = _batch(4)
    offloaded = offload_causal_lm(model, client, head_name(), wire_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask, labels=labels)
    assert out.logits is None and offloaded.remote.last_result.outputs is None


def test_transformers_entry_point_without_transformers(client: Client, head_name) -> None:
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here")
    from losshead.integrations.transformers import offload_lm_head  # imports without it
    model = TinyCausalLM()
    weight = model.lm_head.weight.detach().clone()
    name = head_name()
    with pytest.raises(ImportError, match="^losshead.integrations.transformers needs the "
                                          "'transformers' package"):
        offload_lm_head(model, client, name)
    _assert_untouched(model, weight)
    _assert_no_head(client, name)


# -- real transformers models (where transformers is installed) ---------------------------------
def _tiny_llama(**overrides: object):
    transformers = pytest.importorskip("transformers")
    options = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=False, attn_implementation="eager")
    options.update(overrides)
    config = transformers.LlamaConfig(**options)
    torch.manual_seed(20)
    return transformers.LlamaForCausalLM(config)


def _tiny_gemma2(**overrides: object):
    transformers = pytest.importorskip("transformers")
    options = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=64, final_logit_softcapping=2.0,
                   attn_implementation="eager")
    options.update(overrides)
    config = transformers.Gemma2Config(**options)
    torch.manual_seed(21)
    return transformers.Gemma2ForCausalLM(config)


HF_REL = 1e-4  # the reference is the model's own fp32 forward


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("num_items", [None, 50])
def test_transformers_model_matches_its_own_loss(client: Client, head_name, family: str,
                                                 num_items: Optional[int]) -> None:
    pytest.importorskip("transformers")
    from losshead.integrations.transformers import offload_lm_head
    from transformers.modeling_outputs import CausalLMOutputWithPast
    model = _tiny_llama() if family == "llama" else _tiny_gemma2(tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)  # logits large enough for Gemma's cap to matter
    reference = copy.deepcopy(model)
    input_ids, mask, labels = _batch(30)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    name = head_name()
    offload_lm_head(model, client, name, wire_dtype=torch.float32)
    out, want = _step_both(model, reference, (input_ids, mask, labels), HF_REL, **extra)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits is None
    if family == "gemma2":
        assert model.lm_head is not None and reference.config.final_logit_softcapping == 2.0
        uncapped = copy.deepcopy(reference)
        uncapped.config.final_logit_softcapping = None
        with torch.no_grad():
            plain = uncapped(input_ids, labels=labels, **extra).loss
        assert abs(plain.item() - want.loss.detach().item()) > 0.05


def test_transformers_trainer_evaluate_gets_predictions(client: Client, head_name,
                                                        tmp_path) -> None:
    """A Trainer's evaluate with eval_predictions: compute_metrics receives the predicted ids
    (B, T) as its predictions, with no preprocess_logits_for_metrics and no logits on the
    trainer, and they are those of the model's own head."""
    transformers = pytest.importorskip("transformers")
    from losshead.integrations.transformers import offload_lm_head
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    input_ids, mask, labels = _batch(31)
    rows = [dict(input_ids=input_ids[i], attention_mask=mask[i], labels=labels[i])
            for i in range(B)]
    seen = {}

    def compute_metrics(eval_pred):
        seen["predictions"] = torch.as_tensor(eval_pred.predictions)
        seen["labels"] = torch.as_tensor(eval_pred.label_ids)
        return {}

    offload_lm_head(model, client, head_name(), wire_dtype=torch.float32, eval_predictions=True)
    # Evaluation alone: nothing steps the head, so the Trainer needs no attach.
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=B,
                                          report_to=[], use_cpu=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=rows,
                                   compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    preds = seen["predictions"]
    assert preds.shape == (B, T)
    with torch.no_grad():
        own = reference(input_ids, attention_mask=mask).logits.argmax(-1)
    kept = causal_targets(labels) != -100
    assert float((preds[kept] == own[kept]).double().mean()) > 0.95  # fp32 near-ties aside
    assert bool((preds[~kept] == -1).all())


def _tiny_llama32_tied():
    """Llama-3.2 1B/3B's layout: a Llama with tie_word_embeddings."""
    return _tiny_llama(tie_word_embeddings=True)


def _tiny_gemma3_tied():
    """Gemma 3's text model: a scaled word embedding (its own forward multiplies by
    sqrt(hidden)), tied."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip("this transformers has no Gemma 3")
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        final_logit_softcapping=2.0, attn_implementation="eager", tie_word_embeddings=True)
    torch.manual_seed(22)
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.parametrize("family", ["llama32", "gemma2", "gemma3"])
def test_transformers_tied_model_trains_as_its_own_tied_head(client: Client, head_name,
                                                            family: str) -> None:
    pytest.importorskip("transformers")
    from losshead.integrations.transformers import offload_lm_head
    model = {"llama32": _tiny_llama32_tied, "gemma2": _tiny_gemma2,
             "gemma3": _tiny_gemma3_tied}[family]()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    reference = copy.deepcopy(model)
    name = head_name()
    offloaded = offload_lm_head(model, client, name, wire_dtype=torch.float32)
    assert offloaded.tied and isinstance(model.get_input_embeddings(), OffloadedEmbedding)
    opt = offloaded.optimizer(torch.optim.SGD([p for p in model.parameters() if p.numel()],
                                              lr=0.1), kind="sgd")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, want = [], []
    for k in range(3):
        input_ids, mask, labels = _batch(_seed(family, k))
        for m, o, out in ((model, opt, losses), (reference, ref_opt, want)):
            o.zero_grad()
            loss = m(input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            o.step()
            out.append(loss.detach().item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=HF_REL, atol=1e-6)
    torch.testing.assert_close(client.download_weights(name).weights,
                               reference.lm_head.weight.detach(), rtol=HF_REL, atol=1e-6)


def test_transformers_generate_raises_and_checkpoint_round_trip(client: Client, head_name,
                                                                tmp_path) -> None:
    model = _tiny_llama()
    transformers = pytest.importorskip("transformers")
    from losshead.integrations.transformers import offload_lm_head
    name = head_name()
    offloaded = offload_lm_head(model, client, name, wire_dtype=torch.float32)
    input_ids, mask, labels = _batch(31)
    with pytest.raises(ValueError, match="computes the loss only and needs labels"):
        model.generate(input_ids[:, :4], attention_mask=mask[:, :4], max_new_tokens=2)
    head_opt = RemoteAdamW(client, name, lr=1e-2)
    model(input_ids, attention_mask=mask, labels=labels).loss.backward()
    head_opt.step()
    on_server = client.download_weights(name).weights

    # While offloaded: a complete checkpoint from the model's state dict and the export.
    state = {**model.state_dict(), **offloaded.export_state_dict()}
    model.save_pretrained(tmp_path / "offloaded", state_dict=state)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "offloaded")
    assert torch.equal(loaded.lm_head.weight.detach(), on_server)

    offloaded.restore(model)
    model.save_pretrained(tmp_path / "restored")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "restored")
    assert torch.equal(loaded.lm_head.weight.detach(), on_server)
    for (n, p), (_, q) in zip(sorted(model.state_dict().items()),
                              sorted(loaded.state_dict().items())):
        assert torch.equal(p, q), n
    with torch.no_grad():
        generated = model.generate(input_ids[:, :4], attention_mask=mask[:, :4],
                                   max_new_tokens=2, do_sample=False)
    assert generated.shape[0] == B and 4 < generated.shape[1] <= 6  # may stop at an EOS


# -- the precision of the head's GEMMs -----------------------------------------------------------
@pytest.fixture
def global_matmul_precision() -> Iterator[Callable[[str], None]]:
    """set(p) sets torch's float32 matmul precision for the test; the previous one comes back."""
    previous = torch.get_float32_matmul_precision()
    try:
        yield torch.set_float32_matmul_precision
    finally:
        torch.set_float32_matmul_precision(previous)


def _offload_entry(kind: str):
    """The tiny model and the offload call of each entry point."""
    if kind == "causal_lm":
        return TinyCausalLM(seed=14), offload_causal_lm
    model = _tiny_llama()
    from losshead.integrations.transformers import offload_lm_head
    return model, offload_lm_head


@pytest.mark.parametrize("kind", ["causal_lm", "transformers"])
def test_offloaded_fp32_head_takes_torchs_matmul_precision(client: Client, head_name,
                                                           global_matmul_precision,
                                                           kind: str) -> None:
    """An fp32 head computes as the model's own head would under the process's setting; a
    bf16 one is left at what it computes in anyway; an explicit value wins."""
    global_matmul_precision("high")
    fp32, offload = _offload_entry(kind)
    name = head_name()
    offload(fp32, client, name)
    assert client.get_head(name).spec.matmul_precision == pb.MATMUL_PRECISION_HIGH
    bf16, _ = _offload_entry(kind)
    name = head_name()
    offload(bf16.to(torch.bfloat16), client, name)
    info = client.get_head(name)
    assert info.spec.weight_dtype == pb.DTYPE_BF16
    assert info.spec.matmul_precision == pb.MATMUL_PRECISION_HIGHEST
    as_bf16, _ = _offload_entry(kind)
    name = head_name()
    offload(as_bf16, client, name, head_dtype=torch.bfloat16)  # fp32 model, bf16 head
    assert client.get_head(name).spec.matmul_precision == pb.MATMUL_PRECISION_HIGHEST
    explicit, _ = _offload_entry(kind)
    name = head_name()
    offload(explicit, client, name, matmul_precision="medium")
    assert client.get_head(name).spec.matmul_precision == pb.MATMUL_PRECISION_MEDIUM
    global_matmul_precision("highest")  # torch's default: nothing asked of the server's GEMMs
    default, _ = _offload_entry(kind)
    name = head_name()
    offload(default, client, name)
    assert client.get_head(name).spec.matmul_precision == pb.MATMUL_PRECISION_HIGHEST


def test_offloaded_head_under_high_precision_matches_own_head(client: Client, head_name,
                                                              global_matmul_precision) -> None:
    """The CPU backend computes as "highest" whatever the head allows: the loss and the trunk's
    gradients are still the float64 reference's at fp32 tolerance; a CUDA server's TF32 GEMMs
    at TF32's."""
    global_matmul_precision("high")
    model = TinyCausalLM(seed=15)
    reference = copy.deepcopy(model).double()
    name = head_name()
    offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    assert client.get_head(name).spec.matmul_precision == pb.MATMUL_PRECISION_HIGH
    _step_both(model, reference, _batch(16), CUDA_TF32_REL if on_cuda() else FP32_REL)


def test_offload_refusals_of_matmul_precision_leave_model_and_server(client: Client,
                                                                     head_name) -> None:
    """An unknown value is refused before anything is sent; "high" on a bf16 head is refused by
    the server; either way no head exists and the model keeps its own head."""
    model = TinyCausalLM(seed=17)
    weight = model.lm_head.weight.detach().clone()
    name = head_name()
    with pytest.raises(ValueError, match="^losshead: matmul_precision must be"):
        offload_causal_lm(model, client, name, matmul_precision="tf32")
    _assert_untouched(model, weight)
    _assert_no_head(client, name)
    with pytest.raises(ValueError, match="^losshead: matmul_precision must be"):
        offload_causal_lm(model, client, name, create=False, matmul_precision="fast")
    _assert_untouched(model, weight)
    with pytest.raises(LossheadError) as e:
        offload_causal_lm(model, client, name, head_dtype=torch.bfloat16,
                          matmul_precision="high")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_untouched(model, weight)
    _assert_no_head(client, name)


def test_offload_takes_a_plan_and_refuses_a_bad_one_before_sending(client: Client,
                                                                   head_name) -> None:
    """The model's batches travel as its plan says (the cut the server counts); the keyword
    form builds the same plan; a plan refused leaves no head and the model as it was."""
    model = TinyCausalLM(seed=18)
    reference = copy.deepcopy(model).double()
    weight = model.lm_head.weight.detach().clone()
    bad = head_name()
    for refused in ({"plan": StepPlan(), "streams": 2}, {"wire_dtype": torch.int64}):
        with pytest.raises((TypeError, ValueError)):
            offload_causal_lm(model, client, bad, **refused)  # type: ignore[arg-type]
        _assert_untouched(model, weight)
        _assert_no_head(client, bad)
    plan = StepPlan(streams=2, chunk_tokens=8, min_chunk_tokens=4, depth=2, edge_tokens=0,
                    wire_dtype=torch.float32)
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, plan=plan)
    assert offloaded.remote.plan is plan
    _step_both(model, reference, _batch(19), FP32_REL)
    assert client.get_head(name).microbatches_since_pull == len(plan.chunks(B * T))
    offloaded.restore(model, delete_head=True)
    kept = offload_causal_lm(model, client, head_name(), chunk_tokens=8, streams=2,
                             wire_dtype=torch.float32)
    assert kept.remote.plan == StepPlan(chunk_tokens=8, streams=2, wire_dtype=torch.float32)


# -- a head placed over several of the server's devices ------------------------------------------
def test_transformers_entry_point_offers_every_option() -> None:
    """offload_lm_head takes every option of offload_causal_lm (bar the output type, which is
    transformers' own) with the same defaults: an option missing from the one-line entry point
    would leave Hugging Face users with its default, silently."""
    from losshead.integrations.transformers import offload_lm_head
    full = inspect.signature(offload_causal_lm).parameters
    one_line = inspect.signature(offload_lm_head).parameters
    assert [n for n in full if n not in one_line and n != "output_type"] == []
    for name, parameter in one_line.items():
        if full[name].default is not inspect.Parameter.empty:
            assert parameter.default == full[name].default, name


@pytest.mark.parametrize("kind", ["causal_lm", "transformers"])
@pytest.mark.parametrize("placement", ["replicas", "shards"])
def test_offloaded_head_placed_over_every_device(servers, kind: str, placement: str) -> None:
    """`replicas=0` or `shards=0` places the created head over every device of the server (three
    CPU devices, or two or three GPUs), W uploaded whole; the loss, the trunk's gradients and the
    head's dW are still the model's own."""
    devices = device_count(3, at_least=2)
    server = servers.start(devices_flag(devices))
    model, offload = _offload_entry(kind)
    reference = copy.deepcopy(model)
    rel = HF_REL
    if kind == "causal_lm":
        reference, rel = reference.double(), FP32_REL
    with Client(server.address, client_id="placed") as client:
        offload(model, client, "placed", wire_dtype=torch.float32, **{placement: 0})
        info = client.get_head("placed")
        assert info.spec.placement.kind == (pb.PLACEMENT_SHARDED if placement == "shards"
                                            else pb.PLACEMENT_REPLICATED)
        assert len(info.devices) == devices
        assert torch.equal(client.download_weights("placed").weights,
                           reference.lm_head.weight.detach().float())
        batch = _batch(_seed("placed", kind, placement))
        _step_both(model, reference, batch, rel)
        # The server's window is the token sum; the model's loss is the mean over its tokens.
        pulled = client.pull_gradient("placed", reset=True)
        tokens = int((batch[2][..., 1:] != -100).sum())
        assert_close(pulled.grad / tokens, reference.lm_head.weight.grad, rel, "dW")
