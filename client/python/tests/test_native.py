"""The native data path (liblosshead_capi.so through ctypes) against the gRPC path and torch.

Both paths talk to the same CPU server (deterministic), so their answers must be identical bit
for bit; both are also checked against the float64 reference. run_tests.sh sets
LOSSHEAD_TEST_NATIVE=1 when it built the library into the package: then its absence fails.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Iterator

import grpc
import pytest
import torch

from _reference import assert_close, random_problem, reference
from _servers import NO_RETRY, free_port
from losshead import Client, LossheadError, LossOptions, RemoteLMHead, native_available
from losshead import native_library
from losshead._batch_check import DeviceTargets, HeadFacts, Once, refusal

C = grpc.StatusCode
FP32_REL = 2e-5
needs_native = pytest.mark.skipif(not native_available(),
                                  reason=f"no native library: {native_library()}")


def test_the_native_library_is_used_where_it_was_built(server_address: str) -> None:
    if os.environ.get("LOSSHEAD_TEST_NATIVE") != "1":
        pytest.skip("LOSSHEAD_TEST_NATIVE is not set (no library was built for these tests)")
    assert native_available(), native_library()
    with Client(server_address) as c:
        assert c.native
    with Client(server_address, native=False) as c:
        assert not c.native
    with Client(server_address, channel=grpc.insecure_channel(server_address)) as c:
        assert not c.native  # a caller's channel sees every call
    with pytest.raises(ValueError):
        Client(server_address, channel=grpc.insecure_channel(server_address), native=True)


@pytest.fixture
def paths(server_address: str) -> Iterator[Dict[str, Client]]:
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    with Client(server_address, native=True, client_id="native") as n, \
            Client(server_address, native=False, client_id="grpc") as g:
        assert n.native and not g.native
        yield {"native": n, "grpc": g}


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), what


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_steps_equal_the_grpc_path_and_torch(paths: Dict[str, Client], make_head,
                                             wire: torch.dtype) -> None:
    n, d, v = 300, 40, 77
    hidden, weight, targets = random_problem(n, d, v, seed=70, ignore_fraction=0.2)
    opts = LossOptions(label_smoothing=0.1, z_loss=1e-3)
    results = {}
    for name, c in paths.items():
        head = make_head(v, d, weights=weight)
        one = c.step(head, hidden[:50], targets[:50], hidden_dtype=wire, reduction="sum",
                     return_per_token_loss=True, loss_options=opts)
        chunked = c.step_chunked(head, hidden, targets, chunk_tokens=64, streams=3,
                                 hidden_dtype=wire, loss_options=opts,
                                 return_per_token_loss=True)
        evaluated = c.step(head, hidden[:50], targets[:50], hidden_dtype=wire,
                           forward_only=True, skip_grad_hidden=True, loss_options=opts)
        results[name] = (one, chunked, evaluated, c.pull_gradient(head, reset=True))
    (n1, nc, ne, npull), (g1, gc, ge, gpull) = results["native"], results["grpc"]
    for a, b in ((n1, g1), (nc, gc), (ne, ge)):
        assert (a.loss, a.loss_sum, a.token_count, a.weights_version, a.forward_only) == (
            b.loss, b.loss_sum, b.token_count, b.weights_version, b.forward_only)
    _same(n1.grad_hidden, g1.grad_hidden, "dH of one step")
    _same(nc.grad_hidden, gc.grad_hidden, "dH of the chunks")
    _same(nc.per_token_loss, gc.per_token_loss, "per-token loss")
    assert ne.grad_hidden is None and ne.forward_only
    # Chunks on several streams land in dW in any order: equal up to summation order.
    assert_close(npull.grad, gpull.grad, FP32_REL, "dW")
    assert npull.summary == gpull.summary
    ref = reference(hidden.to(wire), weight, targets, reduction="sum", label_smoothing=0.1,
                    z_loss=1e-3)
    assert nc.token_count == ref.token_count
    assert nc.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(nc.grad_hidden, ref.grad_hidden, FP32_REL if wire == torch.float32 else 2 ** -7,
                 "dH")


def test_transfers_equal_the_grpc_path(paths: Dict[str, Client], make_head) -> None:
    # 1500 x 700 fp32 = 4.2 MB: more than one message each way.
    v, d = 1500, 700
    w = torch.randn(v, d)
    pulled = {}
    for name, c in paths.items():
        head = make_head(v, d, dtype=torch.bfloat16)
        assert c.upload_weights(head, w) == 2  # fp32 on the wire, bf16 on the server
        down = c.download_weights(head)
        _same(down.weights, w.to(torch.bfloat16), f"{name}: W")
        _same(c.download_weights(head, dtype="fp32").weights, w.to(torch.bfloat16).float(),
              f"{name}: W as fp32")
        assert c.push_weights(head, torch.ones(v, d, dtype=torch.bfloat16), add=True,
                              expected_weights_version=2) == 3
        h, _, t = random_problem(64, d, v, seed=71)
        c.step(head, h, t, reduction="sum")
        pulled[name] = (c.pull_gradient(head), c.pull_gradient(head, dtype=torch.bfloat16,
                                                               reset=True))
        assert c.get_head(head).tokens_since_pull == 0
    for a, b in zip(pulled["native"], pulled["grpc"]):
        _same(a.grad, b.grad, "dW")
        assert a.summary == b.summary
    assert pulled["native"][1].summary.was_reset


def test_errors_carry_the_same_codes(paths: Dict[str, Client], make_head) -> None:
    v, d = 9, 4
    head = make_head(v, d, init_std=0.1)
    good_h, good_t = torch.randn(3, d), torch.randint(0, v, (3,))

    def code(fn: Callable[[], object]) -> LossheadError:
        with pytest.raises(LossheadError) as e:
            fn()
        return e.value

    for name, c in paths.items():
        bad = code(lambda: c.step(head, good_h, torch.tensor([0, v, 1])))
        assert bad.code == C.INVALID_ARGUMENT and bad.sequence is not None, name
        assert bad.client_id == c.client_id and bad.message
        stale = code(lambda: c.step(head, good_h, good_t, expected_weights_version=5))
        assert stale.code == C.FAILED_PRECONDITION and stale.sequence is not None, name
        for call in (lambda: c.step("absent", good_h, good_t),
                     lambda: c.pull_gradient("absent"), lambda: c.download_weights("absent"),
                     lambda: c.upload_weights("absent", torch.zeros(2, 2))):
            assert code(call).code == C.NOT_FOUND, name
        assert code(lambda: c.upload_weights(head, torch.zeros(v, d + 1))).code == (
            C.INVALID_ARGUMENT)
        assert code(lambda: c.pull_gradient(head, dtype=torch.int32)).code == C.INVALID_ARGUMENT
    info = paths["native"].get_head(head)
    assert (info.tokens_since_pull, info.microbatches_since_pull) == (0, 0)


@needs_native
def test_unreachable_server_is_a_call_error() -> None:
    with Client(f"127.0.0.1:{free_port()}", native=True, retry=NO_RETRY, timeout=2) as c:
        with pytest.raises(LossheadError) as e:
            c.step("lm", torch.randn(2, 4), torch.zeros(2, dtype=torch.long))
        assert e.value.code == C.UNAVAILABLE and e.value.sequence is None
        with pytest.raises(LossheadError) as e:
            c.upload_weights("lm", torch.zeros(2, 4))
        assert e.value.code == C.UNAVAILABLE
        assert c.retries == 0


@needs_native
def test_large_transfers_into_reused_tensors(paths: Dict[str, Client], make_head) -> None:
    # 4100 x 1100 fp32 = 18 MB: above the size from which the server recycles its transfer
    # buffers, so the second round reuses the first one's (stale bytes must not show).
    v, d = 4100, 1100
    h, _, t = random_problem(256, d, v, seed=73)
    got = {}
    for name, c in paths.items():
        head = make_head(v, d, dtype=torch.bfloat16)
        out_w = torch.full((v, d), 7.0, dtype=torch.bfloat16)
        out_g = torch.full((v, d), 7.0)
        rounds = []
        for k in range(2):
            w = torch.randn(v, d, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
            c.push_weights(head, w)
            down = c.download_weights(head, out=out_w)
            assert down.weights is out_w
            _same(out_w, w, f"{name}: W round {k}")
            c.step(head, h, t, reduction="sum")
            g = c.pull_gradient(head, reset=True, out=out_g)
            assert g.grad is out_g and g.summary.token_count == 256
            rounds.append(out_g.clone())
        got[name] = rounds
        with pytest.raises(ValueError):
            c.pull_gradient(head, out=torch.empty(v, d, dtype=torch.bfloat16))
    for a, b in zip(got["native"], got["grpc"]):
        _same(a, b, "dW")


def test_remote_head_gives_every_stream_work(server_address: str, make_head) -> None:
    n, d, v = 3000, 32, 70
    hidden, weight, targets = random_problem(n, d, v, seed=74, ignore_fraction=0.1)
    head = make_head(v, d, weights=weight)
    with Client(server_address, connections=2) as c:
        m = RemoteLMHead(c, head, chunk_tokens=4096, streams=2, min_chunk_tokens=500, depth=2,
                         edge_tokens=0, wire_dtype=torch.float32)
        h = hidden.detach().requires_grad_()
        loss = m(h, targets)
        loss.backward()
        # Two micro-batches per stream (750 tokens each), not one of 3000 on one stream.
        assert c.get_head(head).microbatches_since_pull == 4
    ref = reference(hidden, weight, targets, reduction="mean")
    assert float(loss) == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(h.grad, ref.grad_hidden, FP32_REL, "dH")


def test_streams_over_several_connections(server_address: str, make_head) -> None:
    n, d, v = 900, 32, 70
    hidden, weight, targets = random_problem(n, d, v, seed=72, ignore_fraction=0.1)
    head = make_head(v, d, weights=weight)
    with Client(server_address, native=True, connections=4) as c:
        r = c.step_chunked(head, hidden, targets, chunk_tokens=100, streams=4)
        assert c.get_head(head).microbatches_since_pull == 9
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
    # A closed client still says how often it retried and refuses new work.
    assert c.retries == 0
    with pytest.raises(LossheadError) as e:
        c.step(head, hidden[:2], targets[:2])
    assert e.value.code == C.FAILED_PRECONDITION


@needs_native
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_remote_head_on_cuda_tensors(server_address: str, make_head) -> None:
    n, d, v = 640, 64, 300
    hidden, weight, targets = random_problem(n, d, v, seed=73, ignore_fraction=0.1)
    head = make_head(v, d, weights=weight)
    with Client(server_address, native=True, connections=2) as c:
        module = RemoteLMHead(c, head, wire_dtype=torch.float32, chunk_tokens=128, streams=2)
        h = hidden.cuda().requires_grad_()
        loss = module(h, targets.cuda())
        loss.backward()
        assert module.last_result is not None
        # Each stream's dH was copied to the device as soon as that stream was done.
        assert module.last_result.grad_hidden.device == h.device
    ref = reference(hidden, weight, targets)
    assert loss.device.type == "cuda" and h.grad.device.type == "cuda"
    assert_close(loss, ref.loss, FP32_REL, "loss")
    assert_close(h.grad, ref.grad_hidden, FP32_REL, "dH")


@needs_native
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dh_copied_to_the_device_per_stream_equals_the_host_copy(server_address: str,
                                                                make_head) -> None:
    n, d, v = 1000, 48, 200
    hidden, weight, targets = random_problem(n, d, v, seed=74, ignore_fraction=0.1)
    head = make_head(v, d, weights=weight)
    chunks = [90, 310, 200, 150, 250]  # uneven, over 3 streams
    with Client(server_address, native=True, connections=3) as c:
        host = c.step_chunked(head, hidden.cuda(), targets, chunks=chunks, streams=3,
                              hidden_dtype=torch.float32)
        # Issued from the streams' threads, ordered on the caller's (non-default) CUDA stream.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            dev = c.step_chunked(head, hidden.cuda(), targets, chunks=chunks, streams=3,
                                 hidden_dtype=torch.float32, grad_hidden_device="cuda")
            on_side = dev.grad_hidden * 1  # queued on `side`, after the copies
        torch.cuda.synchronize()
    assert host.grad_hidden.device.type == "cpu" and host.grad_hidden.is_pinned()
    assert dev.grad_hidden.device.type == "cuda"
    _same(on_side.cpu(), host.grad_hidden, "dH copied per stream")
    assert (dev.loss_sum, dev.token_count) == (host.loss_sum, host.token_count)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert_close(host.grad_hidden, ref.grad_hidden, FP32_REL, "dH")


def _grpc_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes every Step and EmbeddingRows of the gRPC-from-Python path fail: what runs after it
    must take the native path."""
    from losshead import _embeddings, _step_stream

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the native client fell back to the gRPC path")
    monkeypatch.setattr(_step_stream, "step_many", forbidden)
    monkeypatch.setattr(_embeddings.Embeddings, "_embedding_rows_once", forbidden)


# Each per-token input, with the options that take it (server/README.md, "Loss terms").
_TERMS = {
    "token_weights": ({}, ("token_weights",)),
    "policy_gradient": (dict(kind="policy_gradient", clip_low=0.2, clip_high=0.28),
                        ("old_logprob", "advantages")),
    "kl": (dict(kind="policy_gradient", kl_coef=0.05), ("old_logprob", "advantages",
                                                         "ref_logprob")),
    "all": (dict(kind="policy_gradient", kl_coef=0.05, entropy_coef=-0.01, temperature=0.7),
            ("token_weights", "old_logprob", "advantages", "ref_logprob")),
}


@pytest.mark.parametrize("terms", sorted(_TERMS))
def test_token_inputs_equal_the_grpc_path(paths: Dict[str, Client], make_head,
                                          monkeypatch: pytest.MonkeyPatch, terms: str) -> None:
    n, d, v = 200, 24, 53
    hidden, weight, targets = random_problem(n, d, v, seed=72, ignore_fraction=0.1)
    g = torch.Generator().manual_seed(73)
    values = {"token_weights": torch.rand(n, generator=g) * 2,
              "old_logprob": -torch.rand(n, generator=g) * 4 - 1,
              "advantages": torch.randn(n, generator=g),
              "ref_logprob": -torch.rand(n, generator=g) * 4 - 1}
    options, names = _TERMS[terms]
    inputs = {name: values[name] for name in names}
    opts = LossOptions(**options)
    results = {}
    for name in ("native", "grpc"):
        c = paths[name]
        with monkeypatch.context() as m:
            if name == "native":
                _grpc_forbidden(m)
            head = make_head(v, d, weights=weight)
            one = c.step(head, hidden[:60], targets[:60], hidden_dtype=torch.float32,
                         reduction="sum", return_per_token_loss=True, loss_options=opts,
                         **{k: t[:60] for k, t in inputs.items()})
            pulled = c.pull_gradient(head, reset=True)
            chunked = c.step_chunked(head, hidden, targets, chunk_tokens=48, streams=2,
                                     hidden_dtype=torch.float32, loss_options=opts,
                                     return_per_token_loss=True, **inputs)
            results[name] = (one, pulled, chunked)
    (n1, npull, nc), (g1, gpull, gc) = results["native"], results["grpc"]
    for a, b in ((n1, g1), (nc, gc)):
        assert (a.loss, a.loss_sum, a.token_count, a.weights_version) == (
            b.loss, b.loss_sum, b.token_count, b.weights_version)
        _same(a.grad_hidden, b.grad_hidden, f"{terms}: dH")
        _same(a.per_token_loss, b.per_token_loss, f"{terms}: per-token loss")
    _same(npull.grad, gpull.grad, f"{terms}: dW")
    assert npull.summary == gpull.summary
    # The inputs reached the loss: without them the answer differs (or is refused).
    if terms == "token_weights":
        plain = paths["native"].step(make_head(v, d, weights=weight), hidden[:60], targets[:60],
                                     hidden_dtype=torch.float32, reduction="sum")
        assert plain.loss_sum != n1.loss_sum


def test_linear_policy_gradient_equals_the_grpc_path(paths: Dict[str, Client], make_head,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from losshead.functional import linear_policy_gradient
    n, d, v = 96, 16, 41
    hidden, weight, targets = random_problem(n, d, v, seed=74)
    g = torch.Generator().manual_seed(75)
    old, adv = -torch.rand(n, generator=g) * 3 - 1, torch.randn(n, generator=g)
    ref, mask = -torch.rand(n, generator=g) * 3 - 1, (torch.rand(n, generator=g) > 0.3).float()
    got = {}
    for name in ("native", "grpc"):
        with monkeypatch.context() as m:
            if name == "native":
                _grpc_forbidden(m)
            head = make_head(v, d, weights=weight)
            h = hidden.clone().requires_grad_(True)
            loss = linear_policy_gradient(h, targets, old, adv, client=paths[name], head=head,
                                          ref_logprob=ref, kl_coef=0.04, entropy_coef=-0.001,
                                          temperature=0.7, token_weights=mask)
            loss.backward()
            got[name] = (loss.detach(), h.grad, paths[name].pull_gradient(head, reset=True).grad)
    for a, b, what in zip(got["native"], got["grpc"], ("loss", "dH", "dW")):
        _same(a, b, what)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["head", "bf16"])
def test_embedding_rows_and_grads_equal_the_grpc_path(paths: Dict[str, Client], make_head,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      dtype) -> None:
    v, d = 300, 48
    w = torch.randn(v, d)
    ids = torch.randint(0, v, (5, 70), generator=torch.Generator().manual_seed(76))
    grad = torch.randn(5, 70, d, generator=torch.Generator().manual_seed(77))
    got = {}
    for name in ("native", "grpc"):
        c = paths[name]
        with monkeypatch.context() as m:
            if name == "native":
                _grpc_forbidden(m)
            head = make_head(v, d, weights=w)
            rows = c.embedding_rows(head, ids, dtype=dtype)
            c.piece_bytes = 800  # 100 ids a request: the 350 ids over four
            split = c.embedding_rows(head, ids, dtype=dtype)
            first = c.embedding_grad(head, ids, grad, sequence=900)
            again = c.embedding_grad(head, ids, grad, sequence=900)
            got[name] = (rows, split, first, again, c.pull_gradient(head, reset=True))
    (nr, ns, nf, na, npull), (gr, gs, gf, ga, gpull) = got["native"], got["grpc"]
    expected = w[ids.reshape(-1)].to(dtype or torch.float32)
    for a, b in ((nr, gr), (ns, gs)):
        _same(a.rows, b.rows, "rows")
        _same(a.rows, expected, "rows against W")
        assert a.version == b.version == 2
    assert (nf.replayed, na.replayed) == (gf.replayed, ga.replayed) == (False, True)
    assert nf.weights_version == gf.weights_version
    _same(npull.grad, gpull.grad, "dW")
    assert npull.summary == gpull.summary and npull.summary.microbatch_count == 1


def test_embedding_rows_follow_a_head_created_again(paths: Dict[str, Client],
                                                      make_head) -> None:
    c = paths["native"]
    head = make_head(20, 8, weights=torch.randn(20, 8))
    assert c.embedding_rows(head, torch.tensor([1, 2])).rows.shape == (2, 8)
    c.delete_head(head)
    c.create_head(head, 20, 32, weight_dtype=torch.float32)
    w = torch.randn(20, 32)
    c.upload_weights(head, w)
    _same(c.embedding_rows(head, torch.tensor([1, 2])).rows, w[[1, 2]], "rows of the new head")
    c.delete_head(head)  # and narrower, in another dtype
    c.create_head(head, 20, 4, weight_dtype=torch.bfloat16)
    w = torch.randn(20, 4).bfloat16()
    c.upload_weights(head, w)
    _same(c.embedding_rows(head, torch.tensor([3])).rows, w[[3]], "rows of the narrower head")


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bias_head_transfers_equal_the_grpc_path(paths: Dict[str, Client], wire: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A head with an output bias: W and b pushed, added and downloaded, dW and db pulled, on
    the native path (b in a tensor of its own, no grpcio call for the data) as on the gRPC one,
    bit for bit; the refusals keep their codes."""
    from losshead import _transfers

    v, d, n = 29, 12, 40
    g = torch.Generator().manual_seed(77)
    w, b = torch.randn(v, d, generator=g), torch.randn(v, generator=g) * 2
    dw, db = torch.randn(v, d, generator=g), torch.randn(v, generator=g)
    hidden = torch.randn(n, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    got = {}
    for name, c in paths.items():
        head = f"native-bias-{name}-{str(wire)[6:]}"
        c.create_head(head, v, d, weight_dtype=torch.float32, bias=True)
        try:
            if name == "native":
                # The data never goes through grpcio's transfers on the native path.
                for method in ("_download_weights_once", "_pull_gradient_once"):
                    monkeypatch.setattr(_transfers.Transfers, method, _refuse_grpc)
                monkeypatch.setattr(c, "_stub", _NoDataStub(c._stub))
            pushed = c.push_weights(head, w, bias=b, dtype=wire)
            added = c.push_weights(head, dw, bias=db, dtype=wire, add=True,
                                   expected_weights_version=pushed)
            down = c.download_weights(head, dtype=torch.float32)
            down_wire = c.download_weights(head, dtype=wire)
            c.step(head, hidden, targets, hidden_dtype=torch.float32, reduction="sum")
            kept = c.pull_gradient(head)
            pulled = c.pull_gradient(head, reset=True, dtype=wire)
            empty = c.pull_gradient(head, reset=True)
            codes = [_code_of(lambda: c.push_weights(head, w)),
                     _code_of(lambda: c.push_weights(head, w, bias=b[:-1]))]
            got[name] = (pushed, added, down, down_wire, kept, pulled, empty, codes,
                         c.get_head(head).weights_version)
        finally:
            monkeypatch.undo()
            c.delete_head(head)
    n_, g_ = got["native"], got["grpc"]
    assert n_[0] == g_[0] == 2 and n_[1] == g_[1] == 3 and n_[8] == g_[8] == 3
    for i, what in ((2, "download fp32"), (3, "download in the wire dtype")):
        _same(n_[i].weights, g_[i].weights, f"W, {what}")
        _same(n_[i].bias, g_[i].bias, f"b, {what}")
        assert n_[i].version == g_[i].version == 3
    expect_w = w.to(wire).float() + dw.to(wire).float()
    expect_b = b.to(wire).float() + db.to(wire).float()
    _same(n_[2].weights, expect_w, "W against the sums")
    _same(n_[2].bias, expect_b, "b against the sums")
    for i, what in ((4, "kept"), (5, "pulled with reset"), (6, "empty")):
        _same(n_[i].grad, g_[i].grad, f"dW {what}")
        _same(n_[i].grad_bias, g_[i].grad_bias, f"db {what}")
        assert n_[i].summary == g_[i].summary, what
    assert torch.count_nonzero(n_[6].grad_bias) == 0 and n_[5].summary.microbatch_count == 1
    _same(n_[5].grad_bias, n_[4].grad_bias.to(wire), "db in the wire dtype")
    ref_b = torch.nn.functional.softmax(
        hidden.double() @ expect_w.double().T + expect_b.double(), dim=-1)
    ref_db = (ref_b - torch.nn.functional.one_hot(targets, v).double()).sum(0)
    assert_close(n_[4].grad_bias, ref_db, FP32_REL * 10, "db")
    assert n_[7] == g_[7] == [C.INVALID_ARGUMENT, C.INVALID_ARGUMENT]


def _refuse_grpc(*args, **kwargs):
    raise AssertionError("the native path sent a transfer through grpcio")


class _NoDataStub:
    """A stub whose data methods fail the test: the native path's transfers stay native."""

    def __init__(self, stub) -> None:
        self._stub = stub

    def __getattr__(self, name: str):
        if name in ("PushWeights", "PullGradient", "DownloadWeights"):
            return _refuse_grpc
        return getattr(self._stub, name)


def _code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(LossheadError) as e:
        call()
    return e.value.code


@pytest.mark.parametrize("path", ["native", "grpc"])
def test_what_before_send_raises_fails_the_call_with_nothing_sent(paths: Dict[str, Client],
                                                                  make_head, path: str) -> None:
    """run_microbatches' `before_send` (where the device path checks a cut batch) runs on each
    stream's thread once its micro-batches are staged: what it raises fails the call with
    nothing sent. Under `Once`, as step_chunked gives it, the check runs once for all the
    streams, and then the micro-batches go."""
    c = paths[path]
    n, d, v = 64, 8, 11
    name = make_head(v, d, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))

    def cut() -> list:
        return [c.microbatch(name, hidden[a:a + 16], targets[a:a + 16]) for a in range(0, n, 16)]

    threads = []

    def refuse() -> None:
        threads.append(threading.current_thread().name)
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT, "refused before sending")

    with pytest.raises(LossheadError) as e:
        c.run_microbatches(cut(), streams=2, before_send=refuse)
    assert (e.value.code, e.value.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "refused before sending")
    assert len(threads) == 2 and len(set(threads)) == 2
    info = c.get_head(name)
    assert (info.tokens_since_pull, info.microbatches_since_pull) == (0, 0)
    calls = []
    results = c.run_microbatches(cut(), streams=2, before_send=Once(lambda: calls.append(1)))
    assert len(results) == 4 and calls == [1]
    assert c.get_head(name).microbatches_since_pull == 4


def test_once_runs_its_check_once_and_raises_its_error_in_every_caller() -> None:
    """_batch_check.Once from four threads at once: one run, every caller raising its error."""
    runs = []
    gate = threading.Barrier(4)

    def check() -> None:
        runs.append(threading.current_thread().name)
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT, "bad batch")

    once = Once(check)
    raised = []

    def call() -> None:
        gate.wait()
        try:
            once()
        except LossheadError as err:
            raised.append(err)

    workers = [threading.Thread(target=call) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(runs) == 1 and len(raised) == 4
    assert all(err is raised[0] for err in raised) and raised[0].message == "bad batch"


def test_targets_not_judged_on_their_device_are_checked_on_the_host() -> None:
    """DeviceTargets judged under no facts (the head not looked up yet) answer as the same
    targets on the host do: the same refusal word for word, None for good ones, whatever the
    ignore_index in force."""
    facts = HeadFacts(vocab_size=11, dtype=torch.float32, default_ignore_index=-100)
    good = torch.randint(0, 11, (40,), generator=torch.Generator().manual_seed(3))
    good[7] = -100
    high, ignored = good.clone(), good.clone()
    high[33] = 11
    ignored[7], ignored[20] = 3, 5000
    for targets in (good, high, ignored):
        for ignore in (None, 5000):
            want = refusal(facts, 1.0, targets, ignore)
            assert refusal(facts, 1.0, DeviceTargets(targets, None, ignore), ignore) == want
    assert refusal(facts, 1.0, good, None) is None
    assert refusal(facts, 1.0, high, None) == (
        "targets[33] = 11 is outside [0, 11) and is not ignore_index -100")
    assert refusal(facts, 1.0, ignored, 5000) is None
    assert refusal(facts, 1.0, ignored, None).startswith("targets[20] = 5000")
