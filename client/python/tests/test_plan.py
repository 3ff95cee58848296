"""StepPlan: how a batch travels, one type for both Step paths and every way to step."""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Iterator, List, Tuple

import pytest
import torch

import losshead._step_stream as step_stream
from _reference import assert_close, random_problem, reference
from losshead import Client, RemoteLMHead, StepPlan, native_available, native_library
from losshead._native import NativeClient
from losshead._proto.losshead.v1 import losshead_pb2 as pb

FP32_REL = 2e-5


class _Lanes:
    """Records what each Step path was handed: the plan and the micro-batches of each lane."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: List[Tuple[str, StepPlan, List[pb.StepHeader]]] = []
        self._lock = threading.Lock()
        native, grpc_path = NativeClient.step_many, step_stream.step_many

        def on_native(this: NativeClient, mbs, plan,  # type: ignore[no-untyped-def]
                      before_send=None):
            self._note("native", plan, mbs)
            return native(this, mbs, plan, before_send)

        def on_grpc(client, connection, mbs, plan):  # type: ignore[no-untyped-def]
            self._note("grpc", plan, mbs)
            return grpc_path(client, connection, mbs, plan)

        monkeypatch.setattr(NativeClient, "step_many", on_native)
        monkeypatch.setattr(step_stream, "step_many", on_grpc)

    def _note(self, path: str, plan: StepPlan, mbs) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self.calls.append((path, plan, [mb.header for mb in mbs]))

    def take(self) -> List[Tuple[str, StepPlan, List[pb.StepHeader]]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> _Lanes:
    return _Lanes(monkeypatch)


@pytest.fixture
def paths(server_address: str) -> Iterator[Dict[str, Client]]:
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    with Client(server_address, native=True, client_id="plan-native") as n, \
            Client(server_address, native=False, client_id="plan-grpc") as g:
        assert n.native and not g.native
        yield {"native": n, "grpc": g}


def test_the_defaults_are_remote_lm_heads_former_ones() -> None:
    p = StepPlan()
    assert (p.streams, p.chunk_tokens, p.min_chunk_tokens, p.depth, p.edge_tokens,
            p.wire_dtype, p.grad_hidden_dtype, p.max_inflight) == (
        4, 2048, 1024, 4, 256, torch.bfloat16, None, None)
    assert p.chunks(8192) == [256] + [1280] * 6 + [256]  # README's example
    assert StepPlan(streams=1).chunks(8192) == [256, 1920, 1920, 1920, 1920, 256]


def test_a_plan_refuses_what_is_no_floating_wire_dtype() -> None:
    for bad in (torch.int64, "int32"):
        with pytest.raises(ValueError, match="wire_dtype"):
            StepPlan(wire_dtype=bad)
        with pytest.raises(ValueError, match="grad_hidden_dtype"):
            StepPlan(grad_hidden_dtype=bad)
    with pytest.raises(ValueError):
        StepPlan(wire_dtype="fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        StepPlan().streams = 2  # type: ignore[misc]


def test_keywords_build_the_plan_and_read_it(client: Client, make_head) -> None:
    name = make_head(10, 4)
    assert RemoteLMHead(client, name).plan == StepPlan()
    m = RemoteLMHead(client, name, wire_dtype=torch.float32, chunk_tokens=64, streams=3,
                     min_chunk_tokens=16, depth=2, edge_tokens=0, grad_hidden_dtype="fp32")
    assert m.plan == StepPlan(wire_dtype=torch.float32, chunk_tokens=64, streams=3,
                              min_chunk_tokens=16, depth=2, edge_tokens=0,
                              grad_hidden_dtype="fp32")
    assert (m.wire_dtype, m.chunk_tokens, m.streams, m.min_chunk_tokens, m.depth,
            m.edge_tokens, m.grad_hidden_dtype) == (torch.float32, 64, 3, 16, 2, 0, "fp32")
    assert m._chunks_for(500) == m.plan.chunks(500)
    m.streams = 2  # the attribute as before plans: it replaces the plan
    assert m.plan == StepPlan(wire_dtype=torch.float32, chunk_tokens=64, streams=2,
                              min_chunk_tokens=16, depth=2, edge_tokens=0,
                              grad_hidden_dtype="fp32")
    plan = StepPlan(streams=2)
    assert RemoteLMHead(client, name, plan=plan).plan is plan
    with pytest.raises(TypeError, match="streams"):
        RemoteLMHead(client, name, plan=plan, streams=2)


def test_both_paths_get_the_same_plan(paths: Dict[str, Client], make_head,
                                      lanes: _Lanes) -> None:
    n, d, v = 1100, 24, 60
    hidden, weight, targets = random_problem(n, d, v, seed=81, ignore_fraction=0.2)
    plan = StepPlan(streams=3, chunk_tokens=200, min_chunk_tokens=100, depth=2, edge_tokens=50,
                    wire_dtype=torch.float32)
    chunks = plan.chunks(n)
    assert len(chunks) > plan.streams  # every lane carries several micro-batches
    got = {}
    for path, c in paths.items():
        module = RemoteLMHead(c, make_head(v, d, weights=weight), plan=plan)
        h = hidden.clone().requires_grad_()
        loss = module(h, targets)
        loss.backward()
        calls = lanes.take()
        assert {p for p, _, _ in calls} == {path}
        assert all(p is plan for _, p, _ in calls), "each lane runs the module's own plan"
        # Stream j carries micro-batches j, j + streams, ... of the plan's cut.
        lane_sizes = sorted([h.num_tokens for h in headers] for _, _, headers in calls)
        assert lane_sizes == sorted(chunks[j::plan.streams] for j in range(plan.streams))
        assert all(h.hidden_dtype == pb.DTYPE_FP32 for _, _, hs in calls for h in hs)
        got[path] = (loss.detach(), h.grad)
    assert torch.equal(got["native"][0], got["grpc"][0])
    assert torch.equal(got["native"][1], got["grpc"][1])
    ref = reference(hidden, weight, targets)
    assert_close(got["grpc"][0], ref.loss, FP32_REL, "loss")
    assert_close(got["grpc"][1], ref.grad_hidden, FP32_REL, "dH")


def test_a_plan_and_its_keywords_step_alike(client: Client, make_head, lanes: _Lanes) -> None:
    n, d, v = 900, 16, 50
    hidden, weight, targets = random_problem(n, d, v, seed=82, ignore_fraction=0.1)
    cut = dict(streams=2, chunk_tokens=256, min_chunk_tokens=64, depth=3, edge_tokens=32,
               wire_dtype=torch.float32)
    out = []
    for module in (lambda name: RemoteLMHead(client, name, reduction="sum", **cut),
                   lambda name: RemoteLMHead(client, name, reduction="sum",
                                             plan=StepPlan(**cut))):
        name = make_head(v, d, weights=weight)
        m = module(name)
        h = hidden.clone().requires_grad_()
        loss = m(h, targets)
        loss.backward()
        sent = sorted(h.num_tokens for _, _, hs in lanes.take() for h in hs)
        out.append((loss.detach(), h.grad, client.pull_gradient(name, reset=True).grad, sent))
    (l1, dh1, dw1, s1), (l2, dh2, dw2, s2) = out
    assert s1 == s2 == sorted(StepPlan(**cut).chunks(n))
    # Each micro-batch's answer is its own: the same cut gives the same loss and dH bit for bit.
    # dW is summed over streams running at once, in no fixed order: equal up to rounding.
    assert torch.equal(l1, l2) and torch.equal(dh1, dh2)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert_close(l1, ref.loss, FP32_REL, "loss")
    assert_close(dh1, ref.grad_hidden, FP32_REL, "dH")
    for dw in (dw1, dw2):
        assert_close(dw, ref.grad_weight, FP32_REL, "dW")


def test_step_chunked_and_run_microbatches_take_a_plan(client: Client, make_head,
                                                       lanes: _Lanes) -> None:
    n, d, v = 500, 16, 40
    hidden, weight, targets = random_problem(n, d, v, seed=83, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    plan = StepPlan(streams=2, chunk_tokens=128, min_chunk_tokens=32, depth=2, edge_tokens=16,
                    wire_dtype=torch.float32, grad_hidden_dtype=torch.bfloat16)
    by_plan = client.step_chunked(name, hidden, targets, plan=plan, forward_only=True)
    calls = lanes.take()
    assert all(p is plan for _, p, _ in calls)
    headers = [h for _, _, hs in calls for h in hs]
    assert sorted(h.num_tokens for h in headers) == sorted(plan.chunks(n))
    assert {(h.hidden_dtype, h.options.grad_hidden_dtype) for h in headers} == {
        (pb.DTYPE_FP32, pb.DTYPE_BF16)}
    by_hand = client.step_chunked(name, hidden, targets, chunks=plan.chunks(n), streams=2,
                                  hidden_dtype=torch.float32, grad_hidden_dtype=torch.bfloat16,
                                  forward_only=True)
    assert by_plan.loss_sum == by_hand.loss_sum and by_plan.token_count == by_hand.token_count
    assert torch.equal(by_plan.grad_hidden, by_hand.grad_hidden)
    assert by_plan.grad_hidden.dtype == torch.bfloat16
    lanes.take()
    # What is given beside the plan wins over it; streams and chunk_tokens are only the plan's.
    whole = client.step_chunked(name, hidden, targets, plan=plan, chunks=[n],
                                hidden_dtype=torch.bfloat16, grad_hidden_dtype=None,
                                forward_only=True)
    calls = lanes.take()
    assert len(calls) == 1 and len(calls[0][2]) == 1
    header = calls[0][2][0]
    assert (header.num_tokens, header.hidden_dtype, header.options.grad_hidden_dtype) == (
        n, pb.DTYPE_BF16, pb.DTYPE_UNSPECIFIED)
    assert whole.grad_hidden.dtype == torch.bfloat16
    for bad in ({"streams": 2}, {"chunk_tokens": 64}):
        with pytest.raises(TypeError):
            client.step_chunked(name, hidden, targets, plan=plan, **bad)
    mbs = [client.microbatch(name, hidden[:10], targets[:10], forward_only=True)]
    with pytest.raises(TypeError):
        client.run_microbatches(mbs, plan=plan, streams=1)
    (r,) = client.run_microbatches(mbs, plan=StepPlan(streams=3, max_inflight=1))
    assert r.token_count == int((targets[:10] != -100).sum())
    assert client.get_head(name).microbatches_since_pull == 0  # forward-only throughout


def test_evaluation_sends_no_dh_dtype_whatever_the_plan(client: Client, make_head,
                                                        lanes: _Lanes) -> None:
    """As before plans: training steps name the plan's dH dtype, evaluation asks for no dH."""
    n, d, v = 300, 16, 40
    hidden, weight, targets = random_problem(n, d, v, seed=84)
    module = RemoteLMHead(client, make_head(v, d, weights=weight), grad_hidden_dtype="fp32",
                          chunk_tokens=128)
    module(hidden.clone().requires_grad_(), targets).backward()
    trained = [h for _, _, hs in lanes.take() for h in hs]
    with torch.no_grad():
        module(hidden, targets)
    evaluated = [h for _, _, hs in lanes.take() for h in hs]
    assert {h.options.grad_hidden_dtype for h in trained} == {pb.DTYPE_FP32}
    assert {(h.options.grad_hidden_dtype, h.options.skip_grad_hidden, h.options.forward_only)
            for h in evaluated} == {(pb.DTYPE_UNSPECIFIED, True, True)}
