"""The loss terms over the wire (temperature, logit scale, entropy term, token weights, the
clipped policy-gradient loss with its KL term) against torch float64 autograd on the W the server
holds: the loss, dH through backward and the pulled dW, on the gRPC and the native path; a
GRPO-style step of a toy policy (a tiny torch trunk, its head on the server) against the same
objective computed locally; exact statuses on refusals with nothing counted; replays; the
logit scale of Cohere- and Granite-style models."""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace
from typing import Iterator, Optional

import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import losshead.functional as LF
from _reference import assert_close, random_problem
from losshead import Client, LossheadError, LossOptions, StepPlan, native_available
from losshead.integrations._causal_model import model_logit_scale
from test_integrations import head_name  # noqa: F401 - a fixture, used below

IGNORE = -100
# fp32 on the wire, cut into several micro-batches over two streams: the per-token inputs are
# cut with the targets.
PLAN = StepPlan(wire_dtype=torch.float32, chunk_tokens=32, min_chunk_tokens=16, streams=2)


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode()) % 100_000


@pytest.fixture(params=["grpc", "native"])
def path_client(request: pytest.FixtureRequest, server_address: str) -> Iterator[Client]:
    native = request.param == "native"
    if native and not native_available():
        pytest.skip("the native library is not built here")
    with Client(server_address, native=native, client_id=f"terms-{request.param}") as c:
        yield c


def objective(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
              scale: float = 1.0, entropy_coef: float = 0.0,
              token_weights: Optional[torch.Tensor] = None,
              old_logprob: Optional[torch.Tensor] = None,
              advantages: Optional[torch.Tensor] = None,
              ref_logprob: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
              clip_low: float = 0.2, clip_high: float = 0.2, softcap: float = 0.0
              ) -> torch.Tensor:
    """The mean loss over non-ignored tokens, as the proto defines it, in hidden's dtype."""
    logits = F.linear(hidden, weight) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp_all = torch.log_softmax(logits, -1)
    kept = targets != IGNORE
    safe = torch.where(kept, targets, torch.zeros_like(targets))
    logp = logp_all.gather(1, safe[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if advantages is None:
        loss = -logp
    else:
        ratio = torch.exp(logp - old_logprob)
        loss = -torch.min(ratio * advantages,
                          torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages)
        if kl_coef > 0:
            # The low-variance KL: k3 clamped at 10, autograd's gradient through the clamp.
            d = ref_logprob - logp
            loss = loss + kl_coef * torch.clamp(torch.exp(d) - d - 1, max=10.0)
    loss = loss + entropy_coef * entropy
    if token_weights is not None:
        loss = loss * token_weights
    loss = torch.where(kept, loss, torch.zeros_like(loss))
    return loss.sum() / kept.sum()


def check_against_float64(client: Client, name: str, hidden: torch.Tensor, weight: torch.Tensor,
                          targets: torch.Tensor, run, rel: float = 2e-5, **terms) -> None:
    """`run(h)` (the functional call) against `objective` in float64: loss, dH and dW."""
    h = hidden.clone().requires_grad_(True)
    loss = run(h)
    loss.backward()
    pulled = client.pull_gradient(name, reset=True)
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    want = objective(h64, w64, targets,
                     **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                        for k, v in terms.items()})
    want.backward()
    # The functional form steps with SUM and the trainer divides: dW is the token sum.
    count = int((targets != IGNORE).sum())
    assert abs(float(loss) - float(want)) <= rel * max(1.0, abs(float(want))), (
        float(loss), float(want))
    assert_close(h.grad, h64.grad, rel, "dH")
    assert_close(pulled.grad, w64.grad * count, rel, "dW")


@pytest.mark.parametrize("temperature,entropy_coef,weighted",
                         [(None, None, False), (0.7, None, False), (None, -0.05, False),
                          (None, None, True), (1.4, 0.03, True)])
def test_cross_entropy_terms_match_float64(path_client: Client, make_head, temperature,
                                           entropy_coef, weighted) -> None:
    n, d, v = 90, 16, 53
    seed = _seed(temperature, entropy_coef, weighted)
    hidden, weight, targets = random_problem(n, d, v, seed=seed, ignore_fraction=0.2)
    name = make_head(v, d, weights=weight,
                     default_options=LossOptions(logit_scale=1.25))  # the model's scale
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(n, generator=g) * 2 if weighted else None
    scale = float(torch.tensor(1.25 / (temperature or 1.0), dtype=torch.float32))

    def run(h: torch.Tensor) -> torch.Tensor:
        return LF.linear_cross_entropy(h, targets, client=path_client, head=name,
                                       temperature=temperature, entropy_coef=entropy_coef,
                                       token_weights=weights, plan=PLAN)

    check_against_float64(path_client, name, hidden, weight, targets, run, scale=scale,
                          entropy_coef=entropy_coef or 0.0, token_weights=weights)


@pytest.mark.parametrize("kl_coef", [None, 0.1], ids=["no-kl", "kl"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_policy_gradient_matches_float64(path_client: Client, make_head, kl_coef,
                                         weighted) -> None:
    n, d, v = 80, 12, 47
    seed = _seed("pg", kl_coef, weighted)
    hidden, weight, targets = random_problem(n, d, v, seed=seed, ignore_fraction=0.15)
    name = make_head(v, d, weights=weight)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        now = torch.log_softmax(F.linear(hidden.double(), weight.double()) / 0.9, -1)
        logp = now.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    # Old log-probs near the current ones: ratios inside and outside the clip range.
    old = (logp + (torch.rand(n, generator=g) - 0.5) * 0.8).float()
    # Reference log-probs from 4 below to 4 above: k3 clamped (q - log p > 2.61) at some tokens.
    ref = (logp + (torch.rand(n, generator=g) - 0.5) * 8).float()
    adv = ((torch.rand(n, generator=g) - 0.5) * 4).float()
    weights = torch.rand(n, generator=g) if weighted else None

    def run(h: torch.Tensor) -> torch.Tensor:
        return LF.linear_policy_gradient(
            h, targets, old, adv, client=path_client, head=name, temperature=0.9,
            clip_high=0.28, entropy_coef=-0.01, kl_coef=kl_coef,
            ref_logprob=ref if kl_coef else None, token_weights=weights, plan=PLAN)

    check_against_float64(path_client, name, hidden, weight, targets, run,
                          scale=float(torch.tensor(1 / 0.9, dtype=torch.float32)),
                          entropy_coef=float(torch.tensor(-0.01)), token_weights=weights,
                          old_logprob=old, advantages=adv, ref_logprob=ref,
                          kl_coef=float(torch.tensor(kl_coef or 0.0)),
                          clip_high=float(torch.tensor(0.28)))


def test_kl_term_without_a_softcap_is_bounded(client: Client, make_head) -> None:
    """The clamped KL term is bounded whatever log p is: logits that could reach some 1e3 without
    a soft-cap are accepted. Only a coefficient whose own term would overflow is refused
    OUT_OF_RANGE, with nothing counted."""
    n, d, v = 20, 12, 47
    hidden, weight, targets = random_problem(n, d, v, seed=13, hidden_scale=3.0)
    name = make_head(v, d, weights=weight * 3)
    before = client.get_head(name).microbatches_total
    logp = torch.full((n,), -3.0)
    huge = LossOptions(kind="policy_gradient", kl_coef=1e37)
    _expect(grpc.StatusCode.OUT_OF_RANGE,
            lambda: client.step(name, hidden, targets, loss_options=huge, old_logprob=logp,
                                advantages=torch.ones(n), ref_logprob=logp))
    assert client.get_head(name).microbatches_total == before
    options = LossOptions(kind="policy_gradient", kl_coef=0.1)
    assert math.isfinite(client.step(name, hidden, targets, loss_options=options,
                                     old_logprob=logp, advantages=torch.ones(n),
                                     ref_logprob=logp).loss)
    assert client.get_head(name).microbatches_total == before + 1
    client.pull_gradient(name, reset=True)


class ToyPolicy(nn.Module):
    """A tiny trunk: embedding, one tanh layer."""

    def __init__(self, vocab: int, hidden: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layer = nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.embed(ids)))


def test_grpo_step_of_a_toy_policy_matches_local_pytorch(client: Client, make_head) -> None:
    """Two GRPO-style updates of the trunk (the head's W on the server, fixed): the same losses
    and trunk gradients as the objective computed locally in fp32."""
    vocab, d, groups, length = 29, 16, 4, 9
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(vocab, d, generator=g) * 0.4
    name = make_head(vocab, d, weights=weight)
    remote, local = ToyPolicy(vocab, d, 3), ToyPolicy(vocab, d, 3)
    ids = torch.randint(0, vocab, (groups, length), generator=g)
    completion = torch.randint(0, vocab, (groups, length), generator=g)
    mask = torch.ones(groups, length)
    mask[:, :2] = 0  # prompt tokens: counted, weight 0 (the masked token mean)
    targets = completion.clone()
    targets[0, -2:] = IGNORE  # padding
    rewards = torch.randn(groups, generator=g)
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6))[:, None].expand(-1, length)
    with torch.no_grad():
        old = torch.log_softmax(F.linear(local(ids), weight) / 0.8, -1).gather(
            2, completion[..., None])[..., 0]
    for step in range(2):
        for p_r, p_l in zip(remote.parameters(), local.parameters()):
            p_r.grad = p_l.grad = None
        loss_r = LF.linear_policy_gradient(
            remote(ids).reshape(-1, d), targets.reshape(-1), old.reshape(-1),
            adv.reshape(-1).contiguous(), client=client, head=name, temperature=0.8,
            token_weights=mask.reshape(-1), clip_low=0.2, clip_high=0.28, plan=PLAN)
        loss_r.backward()
        loss_l = objective(local(ids).reshape(-1, d), weight, targets.reshape(-1),
                           scale=float(torch.tensor(1 / 0.8)), token_weights=mask.reshape(-1),
                           old_logprob=old.reshape(-1), advantages=adv.reshape(-1),
                           clip_high=float(torch.tensor(0.28)))
        loss_l.backward()
        assert abs(float(loss_r) - float(loss_l)) <= 1e-5 * max(1.0, abs(float(loss_l))), step
        for (pname, p_r), p_l in zip(remote.named_parameters(), local.parameters()):
            assert_close(p_r.grad, p_l.grad, 1e-4, f"step {step}: {pname}")
        with torch.no_grad():
            for p_r, p_l in zip(remote.parameters(), local.parameters()):
                p_r -= 0.5 * p_r.grad
                p_l -= 0.5 * p_l.grad
    client.pull_gradient(name, reset=True)


def _expect(code: grpc.StatusCode, call) -> LossheadError:
    with pytest.raises(LossheadError) as info:
        call()
    assert info.value.code == code, info.value
    return info.value


def test_refusals_are_exact_and_count_nothing(path_client: Client, make_head) -> None:
    n, d, v = 40, 8, 31
    hidden, weight, targets = random_problem(n, d, v, seed=11)
    targets[0] = IGNORE
    name = make_head(v, d, weights=weight)
    old = torch.full((n,), -2.0)
    adv = torch.linspace(-1, 1, n)
    pg = LossOptions(kind="policy_gradient")
    before = path_client.get_head(name).microbatches_total
    step = path_client.step
    nan = adv.clone()
    nan[3] = float("nan")
    huge = adv.clone()
    huge[5] = 3e38
    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=pg, old_logprob=old)),  # no advantages
        (grpc.StatusCode.INVALID_ARGUMENT, dict(old_logprob=old, advantages=adv)),  # CE
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=pg, old_logprob=old, advantages=adv, ref_logprob=old)),  # kl 0
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=LossOptions(kind="policy_gradient", kl_coef=0.1), old_logprob=old,
              advantages=adv)),
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=LossOptions(temperature=0.0))),
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=LossOptions(kind="policy_gradient", clip_low=1.5), old_logprob=old,
              advantages=adv)),
        (grpc.StatusCode.INVALID_ARGUMENT,
         dict(loss_options=pg, old_logprob=old, advantages=nan)),
        (grpc.StatusCode.OUT_OF_RANGE,
         dict(loss_options=pg, old_logprob=old, advantages=huge)),
    ]
    for code, options in cases:
        _expect(code, lambda: step(name, hidden, targets, sequence=1, **options))
    assert path_client.get_head(name).microbatches_total == before
    # The key was never used up; a NaN at an ignored token is not read.
    ignored_nan = adv.clone()
    ignored_nan[0] = float("nan")
    ok = step(name, hidden, targets, sequence=1, loss_options=pg, old_logprob=old,
              advantages=ignored_nan)
    assert not ok.replayed and math.isfinite(ok.loss)
    assert path_client.get_head(name).microbatches_total == before + 1
    path_client.pull_gradient(name, reset=True)


def test_replay_and_other_inputs_are_a_reused_key(path_client: Client, make_head) -> None:
    n, d, v = 30, 8, 23
    hidden, weight, targets = random_problem(n, d, v, seed=12)
    name = make_head(v, d, weights=weight)
    old = torch.full((n,), -3.0)
    adv = torch.linspace(-1, 1, n)
    pg = LossOptions(kind="policy_gradient")
    first = path_client.step(name, hidden, targets, sequence=77, loss_options=pg,
                             old_logprob=old, advantages=adv)
    again = path_client.step(name, hidden, targets, sequence=77, loss_options=pg,
                             old_logprob=old, advantages=adv)
    assert again.replayed and again.loss == first.loss
    assert torch.equal(again.grad_hidden, first.grad_hidden)
    _expect(grpc.StatusCode.ALREADY_EXISTS,
            lambda: path_client.step(name, hidden, targets, sequence=77, loss_options=pg,
                                     old_logprob=old, advantages=adv * 2))
    _expect(grpc.StatusCode.ALREADY_EXISTS,
            lambda: path_client.step(name, hidden, targets, sequence=77,
                                     loss_options=LossOptions(kind="policy_gradient",
                                                              temperature=0.5),
                                     old_logprob=old, advantages=adv))
    path_client.pull_gradient(name, reset=True)


def test_model_logit_scale_reads_cohere_and_granite() -> None:
    assert model_logit_scale(None) == 1.0
    assert model_logit_scale(SimpleNamespace(vocab_size=3)) == 1.0
    assert model_logit_scale(SimpleNamespace(logit_scale=0.0625)) == 0.0625  # Cohere multiplies
    assert model_logit_scale(SimpleNamespace(logits_scaling=8.0)) == 0.125  # Granite divides
    text = SimpleNamespace(logits_scaling=4.0)
    multimodal = SimpleNamespace(get_text_config=lambda: text)
    assert model_logit_scale(multimodal) == 0.25
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^losshead: config\.logit_scale = "):
            model_logit_scale(SimpleNamespace(logit_scale=bad))


def test_scaled_model_trains_on_its_own_loss(client: Client, head_name) -> None:
    """A Cohere-style model (logit_scale) and a Granite-style one (logits_scaling) are offloaded
    with the head's default logit_scale, and the loss and trunk gradients are their own."""
    import copy

    from losshead.integrations.causal_lm import offload_causal_lm
    from test_integrations import TinyCausalLM, _batch  # the same toy model as there

    for field, value, scale in (("logit_scale", 0.0625, 0.0625), ("logits_scaling", 4.0, 0.25)):
        model = TinyCausalLM(seed=9)
        setattr(model.config, field, value)
        reference = copy.deepcopy(model)
        name = head_name()
        offload_causal_lm(model, client, name, wire_dtype=torch.float32)
        assert client.get_head(name).spec.default_options.logit_scale == scale
        input_ids, attention, labels = _batch(5)
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        out.loss.backward()
        hidden = reference.model(input_ids, attention_mask=attention).last_hidden_state
        logits = reference.lm_head(hidden) * scale
        want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1), ignore_index=IGNORE)
        want.backward()
        assert abs(float(out.loss) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), field
        for (pname, p), q in zip(model.model.named_parameters(),
                                 reference.model.parameters()):
            assert_close(p.grad, q.grad, 1e-4, f"{field}: {pname}")
        client.delete_head(name)


def test_transformers_cohere_config_scale() -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: the Cohere / Granite configs' "
                               "field names are checked against the library where it is")
    cohere = transformers.CohereConfig(logit_scale=0.0625)
    assert model_logit_scale(cohere) == 0.0625
    granite = transformers.GraniteConfig(logits_scaling=8.0)
    assert model_logit_scale(granite) == 0.125
