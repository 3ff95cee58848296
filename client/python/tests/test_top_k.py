"""The top-k over the wire (StepOptions.top_k): ids and log-probs against torch float64 on the W
the server holds, on one device, replicated and sharded heads, on the gRPC and the native path,
forward-only and counted, with ignored tokens; replay bit for bit, another top_k a reused key,
k above 16 or the vocabulary INVALID_ARGUMENT with nothing counted; losshead.functional and
RemoteLMHead in the targets' shape."""

from __future__ import annotations

from typing import Iterator

import grpc
import pytest
import torch
import torch.nn.functional as F

import losshead.functional as LF
from _reference import assert_close, random_problem
from _servers import ServerFactory, device_count, devices_flag
from losshead import Client, LossheadError, RemoteLMHead, StepPlan, native_available

IGNORE = -100
LAYOUTS = {"one": {}, "replicated": dict(replicas=2), "sharded": dict(shards=2)}


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server with two (CPU) devices, for replicated and sharded heads."""
    factory = ServerFactory(tmp_path_factory.mktemp("topk"))
    try:
        yield factory.start(devices_flag(device_count(2))).address
    finally:
        factory.stop_all()


@pytest.fixture(params=["grpc", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and not native_available():
        pytest.skip("the native library is not built here")
    return request.param == "native"


def check_top_k(ids: torch.Tensor, logprobs: torch.Tensor, hidden: torch.Tensor,
                weight: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    """Against float64: the ids in decreasing logit (ties by increasing id) except where two
    logits lie within what fp32 cannot tell apart (a near-tie), each id once; the log-probs the
    k largest z - lse; -1 and 0 at ignored tokens."""
    assert ids.dtype == torch.int32 and logprobs.dtype == torch.float32
    assert ids.shape == (targets.numel(), k) and logprobs.shape == ids.shape
    logits = F.linear(hidden.double(), weight.double())
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    kept = targets != IGNORE
    assert bool((ids[~kept] == -1).all()) and bool((logprobs[~kept] == 0).all())
    # A stable sort of -z: decreasing z, equal ones by increasing id.
    want_ids = torch.sort(-logits, dim=-1, stable=True).indices[:, :k]
    want_lp = logp.gather(1, want_ids)
    assert_close(logprobs[kept], want_lp[kept], 2e-5, "top_k_logprobs")
    got = ids[kept].long()
    assert bool((got >= 0).all()) and bool((got < weight.shape[0]).all())
    assert all(len(set(row.tolist())) == k for row in got), "an id twice in a row"
    z, w = logits[kept], want_ids[kept]
    scale = 1e-5 * z.abs().amax(-1, keepdim=True).clamp(min=1.0)
    assert bool(((z.gather(1, w) - z.gather(1, got)).abs() <= scale).all()), "ids"
    assert bool((logprobs[kept][:, 1:] <= logprobs[kept][:, :-1]).all()), "order"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("forward_only", [False, True], ids=["counted", "forward_only"])
def test_top_k_matches_float64_on_every_layout(two_devices: str, native: bool, layout: str,
                                               forward_only: bool) -> None:
    n, d, v = 120, 16, 53
    hidden, weight, targets = random_problem(n, d, v, seed=31 + 2 * len(layout) + forward_only,
                                             ignore_fraction=0.2)
    with Client(two_devices, native=native,
                client_id=f"topk-{layout}-{native}-{forward_only}") as c:
        name = f"topk-{layout}-{native}-{forward_only}"
        c.create_head(name, v, d, weight_dtype=torch.float32, **LAYOUTS[layout])
        c.upload_weights(name, weight)
        for k in (1, 6, 16):
            got = c.step(name, hidden, targets, forward_only=forward_only, top_k=k,
                         token_outputs=["argmax"], return_per_token_loss=True)
            plain = c.step(name, hidden, targets, forward_only=forward_only,
                           return_per_token_loss=True)
            check_top_k(got.outputs.top_k_ids, got.outputs.top_k_logprobs, hidden, weight,
                        targets, k)
            assert torch.equal(got.outputs.top_k_ids[:, 0], got.outputs.argmax)
            assert plain.outputs is None
            # Asking changes nothing else, to the bit.
            assert got.loss == plain.loss and torch.equal(got.grad_hidden, plain.grad_hidden)
            assert torch.equal(got.per_token_loss, plain.per_token_loss)
        assert c.get_head(name).microbatches_total == (0 if forward_only else 6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_is_bit_for_bit_and_another_top_k_is_a_reused_key(two_devices: str, native: bool,
                                                                 layout: str) -> None:
    n, d, v = 64, 16, 29
    hidden, weight, targets = random_problem(n, d, v, seed=41, ignore_fraction=0.2)
    with Client(two_devices, native=native, client_id=f"topk-replay-{layout}-{native}") as c:
        name = f"topk-replay-{layout}-{native}"
        c.create_head(name, v, d, weight_dtype=torch.float32, **LAYOUTS[layout])
        c.upload_weights(name, weight)
        first = c.step(name, hidden, targets, sequence=7, top_k=5)
        again = c.step(name, hidden, targets, sequence=7, top_k=5)
        assert not first.replayed and again.replayed
        assert torch.equal(again.outputs.top_k_ids, first.outputs.top_k_ids)
        assert torch.equal(again.outputs.top_k_logprobs.view(torch.int32),
                           first.outputs.top_k_logprobs.view(torch.int32))
        for other in (dict(top_k=4), dict()):
            with pytest.raises(LossheadError) as e:
                c.step(name, hidden, targets, sequence=7, **other)
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert c.get_head(name).microbatches_total == 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_k_above_16_or_the_vocabulary_is_invalid_argument(two_devices: str, native: bool,
                                                         layout: str) -> None:
    n, d, v = 32, 8, 12
    hidden, weight, targets = random_problem(n, d, v, seed=43, ignore_fraction=0.2)
    with Client(two_devices, native=native, client_id=f"topk-bad-{layout}-{native}") as c:
        name = f"topk-bad-{layout}-{native}"
        c.create_head(name, v, d, weight_dtype=torch.float32, **LAYOUTS[layout])
        c.upload_weights(name, weight)
        for k in (17, 13):
            for forward_only in (False, True):
                with pytest.raises(LossheadError) as e:
                    c.step(name, hidden, targets, sequence=3, top_k=k, forward_only=forward_only)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert (f"options.top_k must be in [0, 16] and at most the vocabulary (12), "
                        f"got {k}") in e.value.message
        info = c.get_head(name)
        assert info.microbatches_total == 0 and info.tokens_since_pull == 0
        # The key was not used up: k = V is the whole distribution, sorted.
        r = c.step(name, hidden, targets, sequence=3, top_k=v)
        assert not r.replayed
        check_top_k(r.outputs.top_k_ids, r.outputs.top_k_logprobs, hidden, weight, targets, v)


def test_function_and_module_give_it_in_the_targets_shape(client: Client, make_head) -> None:
    b, t, d, v = 3, 50, 16, 47
    hidden, weight, targets = random_problem(b * t, d, v, seed=45, ignore_fraction=0.2)
    name = make_head(v, d, weights=weight)
    plan = StepPlan(streams=2, chunk_tokens=64, min_chunk_tokens=32, wire_dtype=torch.float32)
    h = hidden.reshape(b, t, d).requires_grad_()
    tt = targets.reshape(b, t)
    loss, result = LF.linear_cross_entropy(h, tt, client=client, head=name, plan=plan,
                                           training=False, top_k=4, return_result=True)
    plain = LF.linear_cross_entropy(h, tt, client=client, head=name, plan=plan, training=False)
    assert torch.equal(loss, plain)
    assert result.outputs.top_k_ids.shape == (b, t, 4)
    assert result.outputs.top_k_logprobs.shape == (b, t, 4)
    check_top_k(result.outputs.top_k_ids.reshape(-1, 4),
                result.outputs.top_k_logprobs.reshape(-1, 4), hidden, weight, targets, 4)

    module = RemoteLMHead(client, name, plan=plan, top_k=3, token_outputs=["argmax"])
    module.eval()
    with torch.no_grad():
        module(h, tt)
    out = module.last_outputs
    assert out.top_k_ids.shape == (b, t, 3) and out.argmax.shape == (b, t)
    assert torch.equal(out.top_k_ids[..., 0], out.argmax)
    check_top_k(out.top_k_ids.reshape(-1, 3), out.top_k_logprobs.reshape(-1, 3), hidden, weight,
                targets, 3)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        RemoteLMHead(client, name, top_k=-1)
    assert client.get_head(name).microbatches_total == 0
