"""Token outputs (per-token log p(target), entropy, log-sum-exp, argmax, and the correct count)
over the wire, on the gRPC and the native path, against torch float64 on the W the server holds;
exactly-once, bad values and a sharded head as one device; losshead.functional and RemoteLMHead."""

from __future__ import annotations

import zlib
from typing import Iterator

import grpc
import pytest
import torch
import torch.nn.functional as F

import losshead.functional as LF
from _reference import assert_close, random_problem
from _servers import CUDA_BF16_ROUNDING_REL, device_count, devices_flag, on_cuda
from losshead import Client, LossheadError, RemoteLMHead, StepPlan, native_available

ALL = ("logprob", "entropy", "lse", "argmax")
IGNORE = -100


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.fixture(params=["grpc", "native"])
def path_client(request: pytest.FixtureRequest, server_address: str) -> Iterator[Client]:
    native = request.param == "native"
    if native and not native_available():
        pytest.skip("the native library is not built here")
    with Client(server_address, native=native, client_id=f"outputs-{request.param}") as c:
        yield c


def distribution(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict:
    """The predicted distribution per token in float64, as the proto defines the outputs."""
    logits = F.linear(hidden.double(), weight.double())
    lse = torch.logsumexp(logits, -1)
    logp = logits - lse[:, None]
    kept = targets != IGNORE
    safe = torch.where(kept, targets, torch.zeros_like(targets))
    logprob = torch.where(kept, logp.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse))
    entropy = torch.where(kept, -(logp.exp() * logp).sum(-1), torch.zeros_like(lse))
    argmax = torch.where(kept, logits.argmax(-1), torch.full_like(targets, -1))
    return dict(logits=logits, lse=lse, logprob=logprob, entropy=entropy, argmax=argmax,
                correct=int((kept & (argmax == targets)).sum()))


def outputs_rel(dtype: torch.dtype) -> float:
    """fp32's tolerance; a bf16 head's on a CUDA server, whose logits are kept in bf16."""
    return CUDA_BF16_ROUNDING_REL if on_cuda() and dtype != torch.float32 else 2e-5


def check_outputs(outputs, want: dict, targets: torch.Tensor, rel: float) -> None:
    assert outputs is not None
    assert outputs.logprob.dtype == torch.float32 and outputs.argmax.dtype == torch.int32
    assert_close(outputs.logprob, want["logprob"], rel, "logprob")
    assert_close(outputs.entropy, want["entropy"], rel, "entropy")
    assert_close(outputs.lse, want["lse"], rel, "lse")
    kept = targets != IGNORE
    got = outputs.argmax.long()
    assert torch.equal(got[~kept], torch.full_like(got[~kept], -1))
    assert bool((outputs.logprob[~kept] == 0).all()) and bool((outputs.entropy[~kept] == 0).all())
    # An argmax may differ from the float64 one only between logits the stored precision cannot
    # tell apart: fp32's rounding, or one bf16 step (2^-7 of the value) where logits are bf16.
    tie = 1e-5 if rel <= 2e-5 else 2.0 ** -7
    rows = torch.nonzero(kept & (got != want["argmax"]))[:, 0]
    for t in rows.tolist():
        z = want["logits"][t]
        assert float(z.max() - z[got[t]]) <= tie * max(1.0, float(z.abs().max())), t
    assert outputs.correct_count == int((kept & (got == targets)).sum())
    if rows.numel() == 0:
        assert outputs.correct_count == want["correct"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("forward_only", [False, True], ids=["counted", "forward_only"])
def test_outputs_match_float64_and_change_nothing_else(path_client: Client, make_head,
                                                       dtype: torch.dtype, reduction: str,
                                                       forward_only: bool) -> None:
    n, d, v = 150, 24, 61
    hidden, weight, targets = random_problem(n, d, v, seed=_seed(dtype, reduction, forward_only),
                                             ignore_fraction=0.2)
    hidden = hidden.to(dtype)
    name = make_head(v, d, weights=weight, dtype=dtype)
    w = path_client.download_weights(name).weights  # what the server holds, in its dtype
    common = dict(reduction=reduction, forward_only=forward_only, return_per_token_loss=True,
                  hidden_dtype=dtype)
    got = path_client.step(name, hidden, targets, token_outputs=ALL, return_correct_count=True,
                           **common)
    plain = path_client.step(name, hidden, targets, **common)
    assert got.forward_only == forward_only
    check_outputs(got.outputs, distribution(hidden, w, targets), targets, outputs_rel(dtype))
    assert got.accuracy == got.outputs.correct_count / got.token_count
    assert plain.outputs is None and plain.accuracy is None
    # Asking changes nothing else, to the bit.
    assert got.loss == plain.loss and got.loss_sum == plain.loss_sum
    assert got.token_count == plain.token_count
    assert torch.equal(got.grad_hidden, plain.grad_hidden)
    assert torch.equal(got.per_token_loss, plain.per_token_loss)


def test_outputs_of_a_chunked_batch_come_back_in_token_order(path_client: Client,
                                                             make_head) -> None:
    n, d, v = 700, 16, 37
    hidden, weight, targets = random_problem(n, d, v, seed=3, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    r = path_client.step_chunked(name, hidden, targets, chunk_tokens=96, streams=3,
                                 token_outputs=["argmax", "LSE"], return_correct_count=True,
                                 skip_grad_hidden=True, forward_only=True)
    assert r.outputs.logprob is None and r.outputs.entropy is None
    want = distribution(hidden, weight, targets)
    assert_close(r.outputs.lse, want["lse"], 2e-5, "lse")
    assert r.outputs.argmax.shape == (n,)
    assert r.outputs.correct_count == int(((r.outputs.argmax.long() == targets)
                                           & (targets != IGNORE)).sum())


def test_replay_answers_the_same_outputs_and_others_are_a_reused_key(path_client: Client,
                                                                     make_head) -> None:
    n, d, v = 64, 16, 29
    hidden, weight, targets = random_problem(n, d, v, seed=4, ignore_fraction=0.2)
    name = make_head(v, d, weights=weight)
    seq = 10_000 + _seed("replay") % 1000
    first = path_client.step(name, hidden, targets, sequence=seq,
                             token_outputs=["logprob", "argmax"], return_correct_count=True)
    again = path_client.step(name, hidden, targets, sequence=seq,
                             token_outputs=["argmax", "logprob"], return_correct_count=True)
    assert not first.replayed and again.replayed
    assert torch.equal(again.outputs.logprob.view(torch.int32),
                       first.outputs.logprob.view(torch.int32))
    assert torch.equal(again.outputs.argmax, first.outputs.argmax)
    assert again.outputs.correct_count == first.outputs.correct_count
    for other in (dict(token_outputs=["logprob"], return_correct_count=True),
                  dict(token_outputs=["logprob", "argmax"]), dict()):
        with pytest.raises(LossheadError) as e:
            path_client.step(name, hidden, targets, sequence=seq, **other)
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert path_client.get_head(name).microbatches_total == 1


def test_bad_values_are_invalid_argument(path_client: Client, make_head) -> None:
    n, d, v = 16, 8, 11
    hidden, weight, targets = random_problem(n, d, v, seed=5)
    name = make_head(v, d, weights=weight)
    for values, message in (([0], "token_outputs[0] = TOKEN_OUTPUT_UNSPECIFIED"),
                            ([1, 77], "token_outputs[1] = 77 is not a token output"),
                            (["argmax", "argmax"], "token_outputs[1] = TOKEN_OUTPUT_ARGMAX "
                                                   "repeats")):
        with pytest.raises(LossheadError) as e:
            path_client.step(name, hidden, targets, token_outputs=values)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in e.value.message
    with pytest.raises(ValueError, match="unknown token output 'top1'"):
        path_client.step(name, hidden, targets, token_outputs=["top1"])
    assert path_client.get_head(name).microbatches_total == 0


def test_a_sharded_head_answers_them_as_one_device(servers) -> None:
    server = servers.start(devices_flag(device_count(2)))
    n, d, v = 80, 16, 31
    hidden, weight, targets = random_problem(n, d, v, seed=6, ignore_fraction=0.1)
    want = distribution(hidden, weight, targets)
    for native in sorted({False, native_available()}):
        with Client(server.address, native=native, client_id=f"shard-{native}") as c:
            got = {}
            for layout, kwargs in (("one", {}), ("sharded", dict(shards=2))):
                name = f"{layout}-{native}"
                c.create_head(name, v, d, weight_dtype=torch.float32, **kwargs)
                c.upload_weights(name, weight)
                got[layout] = c.step(name, hidden, targets, sequence=1, token_outputs=ALL,
                                     return_correct_count=True)
                check_outputs(got[layout].outputs, want, targets, 2e-5)
            one, sharded = got["one"].outputs, got["sharded"].outputs
            assert sharded.correct_count == one.correct_count
            for field in ("logprob", "entropy", "lse"):
                assert_close(getattr(sharded, field), getattr(one, field), 2e-5, field)
            # Replay over shards answers the same bits; counted once.
            again = c.step(f"sharded-{native}", hidden, targets, sequence=1, token_outputs=ALL,
                           return_correct_count=True)
            assert again.replayed
            for field in ALL:
                assert torch.equal(getattr(again.outputs, field).view(torch.int32),
                                   getattr(sharded, field).view(torch.int32)), field
            assert c.get_head(f"sharded-{native}").microbatches_total == 1


def test_function_and_module_give_them_in_the_targets_shape(client: Client, make_head) -> None:
    b, t, d, v = 4, 45, 16, 53
    hidden, weight, targets = random_problem(b * t, d, v, seed=7, ignore_fraction=0.2)
    name = make_head(v, d, weights=weight)
    plan = StepPlan(streams=2, chunk_tokens=64, min_chunk_tokens=32, wire_dtype=torch.float32)
    h = hidden.reshape(b, t, d).requires_grad_()
    tt = targets.reshape(b, t)
    loss, result = LF.linear_cross_entropy(h, tt, client=client, head=name, plan=plan,
                                           training=False, token_outputs=ALL,
                                           return_correct_count=True, return_result=True)
    plain = LF.linear_cross_entropy(h, tt, client=client, head=name, plan=plan, training=False)
    assert torch.equal(loss, plain)
    want = distribution(hidden, weight, targets)
    assert result.outputs.argmax.shape == (b, t)
    check_outputs(result.outputs.map(lambda x: x.reshape(-1)), want, targets, 2e-5)

    module = RemoteLMHead(client, name, plan=plan, token_outputs=["entropy"])
    module.eval()
    with torch.no_grad():
        module(h, tt)
    assert module.last_outputs.entropy.shape == (b, t)
    assert module.last_outputs.argmax is None and module.last_outputs.correct_count is None
    assert_close(module.last_outputs.entropy.reshape(-1), want["entropy"], 2e-5, "entropy")
    assert client.get_head(name).microbatches_total == 0
