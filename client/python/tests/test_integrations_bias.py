"""losshead.integrations with an lm_head that has a bias (Phi's layout): the head is created with
an output bias holding lm_head.bias, the offloaded model trains as the same model with its own
head (loss, trunk gradients, dW and db, then several optimizer steps), and the bias goes
everywhere W goes: the export, restore and local_head, a loaded state dict, the files a
checkpoint gets, and the JointOptimizer's weight decay of it.

The first part needs no model library (the hand-written model of test_integrations.py, with a
bias); the tests that build a tiny PhiForCausalLM skip without transformers and run where it is
installed (the GPU host's environment).
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import List

import grpc
import pytest
import torch
from torch import nn

from _reference import assert_close
from losshead import Client, LossheadError
from losshead.integrations._checkpoint_files import add_tensors
from losshead.integrations.causal_lm import OffloadedLMHead, offload_causal_lm
from test_integrations import (BF16_REL, D, FP32_REL, V, TinyCausalLM, _batch, _seed, _step_both,
                               head_name)  # noqa: F401 (head_name: a fixture)


class BiasedCausalLM(TinyCausalLM):
    """TinyCausalLM whose lm_head is nn.Linear(D, V, bias=True), b drawn large enough to matter
    (its own forward, the reference, adds it to the logits)."""

    def __init__(self, seed: int = 0, **kwargs: object) -> None:
        super().__init__(seed=seed, **kwargs)
        weight = self.lm_head.weight.detach().clone()
        self.lm_head = nn.Linear(D, V, bias=True)
        self.lm_head.weight.data = weight
        nn.init.normal_(self.lm_head.bias, std=1.0)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, tag: str) -> List[float]:
    losses = []
    for k in range(steps):
        input_ids, mask, labels = _batch(_seed(tag, k))
        optimizer.zero_grad()
        loss = model(input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bias_uploaded_and_loss_dw_db_match_own_head(client: Client, head_name,
                                                     precision: str) -> None:
    model = BiasedCausalLM(seed=_seed("bias", precision))
    if precision == "bf16":
        # W what a bf16 head holds; b stays fp32 (the server keeps it so, and it goes up in fp32).
        model.lm_head.weight.data = model.lm_head.weight.data.bfloat16().float()
    bias = model.lm_head.bias
    original = bias.detach().clone()
    reference = copy.deepcopy(model).double()
    wire = torch.float32 if precision == "fp32" else torch.bfloat16
    rel = FP32_REL if precision == "fp32" else BF16_REL
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, head_dtype=wire, wire_dtype=wire)
    info = client.get_head(name)
    assert info.spec.bias and offloaded.has_bias
    assert info.weights_version == 2  # created, then W and b pushed once, together
    held = client.download_weights(name, dtype=torch.float32)
    assert torch.equal(held.bias, original)  # exact: b went up in fp32 for the bf16 head too
    # No V-sized tensor left locally either, and no lm_head key in the model's state.
    assert bias.numel() == 0 and isinstance(model.lm_head, OffloadedLMHead)
    assert model.lm_head.bias.device.type == "meta" and model.lm_head.bias.numel() == 0
    assert all(not k.startswith("lm_head") for k in model.state_dict())

    input_ids, mask, labels = _batch(_seed("bias", precision, "batch"))
    kept = int((labels[..., 1:] != -100).sum())
    _step_both(model, reference, (input_ids, mask, labels), rel)
    pulled = client.pull_gradient(name)
    assert_close(pulled.grad, reference.lm_head.weight.grad * kept, rel, "dW")
    assert_close(pulled.grad_bias, reference.lm_head.bias.grad * kept, rel, "db")
    # The bias matters at this scale: the model without it has another loss.
    plain = copy.deepcopy(reference)
    plain.lm_head.bias.data.zero_()
    with torch.no_grad():
        assert abs(plain(input_ids, labels=labels).loss.item() -
                   reference(input_ids, labels=labels).loss.item()) > 0.05


@pytest.mark.parametrize("decay", ["one_group", "no_decay_on_bias"])
def test_biased_model_trains_as_its_own_head(client: Client, head_name, decay: str) -> None:
    """AdamW over trunk and head for a few steps: the losses, W and b as torch's, with b's
    weight decay as one param group would give it or (bias_weight_decay=0) as a no-decay group
    would."""
    model = BiasedCausalLM(seed=21)
    reference = copy.deepcopy(model)
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    trunk = [p for p in model.parameters() if p.numel()]
    options = {} if decay == "one_group" else {"bias_weight_decay": 0.0}
    opt = offloaded.optimizer(torch.optim.AdamW(trunk, lr=2e-2, weight_decay=0.1), **options)
    if decay == "one_group":
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-2, weight_decay=0.1)
    else:
        others = [p for n, p in reference.named_parameters() if n != "lm_head.bias"]
        ref_opt = torch.optim.AdamW([{"params": others},
                                     {"params": [reference.lm_head.bias], "weight_decay": 0.0}],
                                    lr=2e-2, weight_decay=0.1)
    losses = _train(model, opt, 4, "bias-train")
    want = _train(reference, ref_opt, 4, "bias-train")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    held = client.download_weights(name)
    torch.testing.assert_close(held.weights, reference.lm_head.weight.detach(), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(held.bias, reference.lm_head.bias.detach(), rtol=1e-5, atol=1e-6)
    # The decay of b is what tells the two apart: without any, b moved by Adam alone.
    assert client.get_head(name).optimizer_step == 4


def test_bias_exported_restored_and_back_for_a_block(client: Client, head_name) -> None:
    model = BiasedCausalLM(seed=22)
    linear, bias_param = model.lm_head, model.lm_head.bias
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    trained_b = torch.randn(V, generator=torch.Generator().manual_seed(3))
    trained_w = torch.randn(V, D, generator=torch.Generator().manual_seed(4)) * 0.3
    version = client.push_weights(name, trained_w, bias=trained_b)
    exported = offloaded.export_state_dict()
    assert sorted(exported) == ["lm_head.bias", "lm_head.weight"]
    assert torch.equal(exported["lm_head.weight"], trained_w)
    assert torch.equal(exported["lm_head.bias"], trained_b)

    input_ids, _, labels = _batch(23)
    with offloaded.local_head(model) as local:
        assert local.lm_head is linear and local.lm_head.bias is bias_param
        assert torch.equal(bias_param.detach(), trained_b)
        hidden = local.model(input_ids).last_hidden_state
        logits = local(input_ids, labels=labels).logits
        assert torch.equal(logits, hidden @ trained_w.T + trained_b)
    assert bias_param.numel() == 0 and isinstance(model.lm_head, OffloadedLMHead)

    assert offloaded.restore(model) == version
    assert model.lm_head is linear and model.lm_head.bias is bias_param
    assert torch.equal(model.state_dict()["lm_head.bias"], trained_b)
    assert torch.equal(model.state_dict()["lm_head.weight"], trained_w)


def test_loaded_state_dict_uploads_w_and_b_in_one_push(client: Client, head_name) -> None:
    model = BiasedCausalLM(seed=24)
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    g = torch.Generator().manual_seed(25)
    w, b = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    before = client.get_head(name).weights_version
    model.load_state_dict({**model.state_dict(), "lm_head.weight": w, "lm_head.bias": b})
    assert client.get_head(name).weights_version == before + 1  # one push for both
    held = client.download_weights(name)
    assert torch.equal(held.weights, w) and torch.equal(held.bias, b)
    assert offloaded.weights_version == before + 1

    # b alone (a checkpoint that keeps W elsewhere): b replaced, W kept.
    b2 = torch.randn(V, generator=g)
    missing = model.load_state_dict({**model.state_dict(), "lm_head.bias": b2}, strict=False)
    assert "lm_head.weight" in missing.missing_keys
    held = client.download_weights(name)
    assert torch.equal(held.weights, w) and torch.equal(held.bias, b2)
    # W alone: the strict load reports b missing; W replaced, b kept.
    w2 = torch.randn(V, D, generator=g)
    with pytest.raises(RuntimeError, match=re.escape('Missing key(s) in state_dict: '
                                                     '"lm_head.bias"')):
        model.load_state_dict({**model.state_dict(), "lm_head.weight": w2})
    held = client.download_weights(name)
    assert torch.equal(held.weights, w2) and torch.equal(held.bias, b2)
    # A bias of another length: refused, nothing sent.
    version = client.get_head(name).weights_version
    with pytest.raises(RuntimeError, match=re.escape("size mismatch for lm_head.bias")):
        model.load_state_dict({**model.state_dict(), "lm_head.weight": w,
                               "lm_head.bias": torch.zeros(V + 1)})
    assert client.get_head(name).weights_version == version


def test_attach_needs_a_bias_exactly_when_the_model_has_one(client: Client, head_name) -> None:
    plain, biased = head_name(), head_name()
    client.create_head(plain, V, D, weight_dtype=torch.float32)
    client.create_head(biased, V, D, weight_dtype=torch.float32, bias=True)
    model = BiasedCausalLM(seed=26)
    weight, bias = model.lm_head.weight.detach().clone(), model.lm_head.bias.detach().clone()
    with pytest.raises(ValueError, match=re.escape(
            f"losshead: head {plain!r} has no output bias, the model's lm_head has bias")):
        offload_causal_lm(model, client, plain, create=False)
    assert torch.equal(model.lm_head.weight.detach(), weight)
    assert torch.equal(model.lm_head.bias.detach(), bias)
    with pytest.raises(ValueError, match=re.escape(
            f"losshead: head {biased!r} has output bias, the model's lm_head has no bias")):
        offload_causal_lm(TinyCausalLM(seed=27), client, biased, create=False)
    # The matching head: attached, nothing uploaded, b the server's.
    version = client.push_weights(biased, weight, bias=bias * 2)
    offloaded = offload_causal_lm(model, client, biased, create=False, wire_dtype=torch.float32)
    assert offloaded.weights_version == version == client.get_head(biased).weights_version
    assert torch.equal(offloaded.export_state_dict()["lm_head.bias"], bias * 2)


def test_checkpoint_files_get_w_and_b_in_one_shard(tmp_path) -> None:
    """A sharded torch checkpoint: lm_head.weight and lm_head.bias in one shard of their own
    (one load, one push), in the index with the total size; a single file gets both."""
    directory = tmp_path / "sharded"
    directory.mkdir()
    torch.save({"model.norm.weight": torch.ones(D)}, directory / "pytorch_model-00001.bin")
    index = {"metadata": {"total_size": 4 * D},
             "weight_map": {"model.norm.weight": "pytorch_model-00001.bin"}}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    w, b = torch.randn(V, D), torch.randn(V)
    shard = add_tensors(str(directory), {"lm_head.weight": w, "lm_head.bias": b})
    assert os.path.basename(shard) == "pytorch_model-lm_head_weight.bin"
    saved = torch.load(shard)
    assert sorted(saved) == ["lm_head.bias", "lm_head.weight"]
    assert torch.equal(saved["lm_head.weight"], w) and torch.equal(saved["lm_head.bias"], b)
    index = json.loads((directory / "pytorch_model.bin.index.json").read_text())
    assert index["weight_map"]["lm_head.bias"] == index["weight_map"]["lm_head.weight"] == (
        "pytorch_model-lm_head_weight.bin")
    assert index["metadata"]["total_size"] == 4 * (D + V * D + V)

    single = tmp_path / "single"
    single.mkdir()
    torch.save({"model.norm.weight": torch.ones(D)}, single / "pytorch_model.bin")
    add_tensors(str(single), {"lm_head.weight": w, "lm_head.bias": b})
    saved = torch.load(single / "pytorch_model.bin")
    assert sorted(saved) == ["lm_head.bias", "lm_head.weight", "model.norm.weight"]
    assert torch.equal(saved["lm_head.bias"], b)


def test_a_bias_for_a_head_without_one_is_refused(client: Client, head_name) -> None:
    model = TinyCausalLM(seed=28)
    name = head_name()
    offloaded = offload_causal_lm(model, client, name, wire_dtype=torch.float32)
    with pytest.raises(ValueError, match="has no output bias"):
        offloaded.upload_weight(torch.zeros(V, D), torch.zeros(V))
    assert client.get_head(name).weights_version == 2
    assert "lm_head.bias" not in offloaded.export_state_dict()
    with pytest.raises(LossheadError) as e:
        client.push_weights(name, torch.zeros(V, D), bias=torch.zeros(V))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


# -- a tiny Phi (where transformers is installed) ------------------------------------------------
def _tiny_phi():
    transformers = pytest.importorskip(
        "transformers", reason="the Phi tests need transformers (run them on the GPU host)")
    config = transformers.PhiConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=0.5,
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(29)
    model = transformers.PhiForCausalLM(config)
    assert model.lm_head.bias is not None  # Phi's head has a bias: what these tests are about
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.3)
    return model


HF_REL = 1e-4  # the reference is the model's own fp32 forward


def test_phi_trains_offloaded_as_with_its_own_head(client: Client, head_name) -> None:
    model = _tiny_phi()
    from losshead.integrations.transformers import offload_lm_head
    reference = copy.deepcopy(model)
    name = head_name()
    offloaded = offload_lm_head(model, client, name, wire_dtype=torch.float32)
    assert client.get_head(name).spec.bias and offloaded.has_bias
    opt = offloaded.optimizer(torch.optim.AdamW([p for p in model.parameters() if p.numel()],
                                                lr=1e-2, weight_decay=0.01))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    losses = _train(model, opt, 4, "phi")
    want = _train(reference, ref_opt, 4, "phi")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=HF_REL, atol=1e-5)
    assert losses[-1] < losses[0]
    held = client.download_weights(name)
    torch.testing.assert_close(held.weights, reference.lm_head.weight.detach(), rtol=HF_REL,
                               atol=1e-5)
    torch.testing.assert_close(held.bias, reference.lm_head.bias.detach(), rtol=HF_REL,
                               atol=1e-5)


def test_phi_checkpoint_round_trip_keeps_the_bias(client: Client, head_name, tmp_path) -> None:
    model = _tiny_phi()
    transformers = pytest.importorskip("transformers")
    from losshead.integrations.transformers import offload_lm_head
    name = head_name()
    offloaded = offload_lm_head(model, client, name, wire_dtype=torch.float32)
    opt = offloaded.optimizer(torch.optim.AdamW([p for p in model.parameters() if p.numel()],
                                                lr=1e-2))
    _train(model, opt, 2, "phi-save")
    on_server = client.download_weights(name)

    # While offloaded: a complete checkpoint from the model's state dict and the export.
    state = {**model.state_dict(), **offloaded.export_state_dict()}
    model.save_pretrained(tmp_path / "offloaded", state_dict=state)
    loaded = transformers.PhiForCausalLM.from_pretrained(tmp_path / "offloaded")
    assert torch.equal(loaded.lm_head.weight.detach(), on_server.weights)
    assert torch.equal(loaded.lm_head.bias.detach(), on_server.bias)

    # Resuming into an offloaded model: the loaded W and b go up to the server.
    other = _tiny_phi()
    resumed = offload_lm_head(other, client, head_name(), wire_dtype=torch.float32)
    other.load_state_dict(loaded.state_dict())
    held = client.download_weights(resumed.head)
    assert torch.equal(held.weights, on_server.weights) and torch.equal(held.bias, on_server.bias)

    offloaded.restore(model)
    model.save_pretrained(tmp_path / "restored")
    again = transformers.PhiForCausalLM.from_pretrained(tmp_path / "restored")
    assert torch.equal(again.lm_head.bias.detach(), on_server.bias)
