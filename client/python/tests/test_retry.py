"""Retries: backpressure refusals with a hint, UNAVAILABLE across server restarts, reset pulls
never re-sent, pushes re-sent only where a repeat cannot add twice; checkpoints and progress."""

from __future__ import annotations

import signal
import threading
import time
from typing import List

import grpc
import pytest
import torch

from _reference import assert_close, random_problem, reference
from _servers import NO_RETRY, ServerFactory
from losshead import Client, LossheadError, RetryPolicy
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead.retry import is_retryable, retry_after

C = grpc.StatusCode
FP32_REL = 2e-5
PATIENT = RetryPolicy(max_attempts=40, initial_backoff=0.02, max_backoff=0.1)


# -- the policy itself ---------------------------------------------------------------------
def test_policy_defaults_match_the_cpp_client() -> None:
    p = RetryPolicy()
    assert (p.max_attempts, p.initial_backoff, p.max_backoff, p.multiplier, p.jitter) == (
        5, 0.05, 2.0, 2.0, 0.2)


def test_backoff_is_exponential_capped_jittered_and_honours_the_hint() -> None:
    exact = RetryPolicy(initial_backoff=0.05, max_backoff=0.3, multiplier=2.0, jitter=0.0)
    assert [exact.delay(k) for k in range(1, 6)] == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.3])
    jittered = RetryPolicy(jitter=0.2)
    for k in range(1, 8):
        base = min(0.05 * 2 ** (k - 1), 2.0)
        for _ in range(50):
            assert 0.8 * base - 1e-12 <= jittered.delay(k) <= 1.2 * base + 1e-12
    hinted = LossheadError(C.RESOURCE_EXHAUSTED, "retry after 700 ms", sequence=1,
                           retry_after_ms=700)
    assert retry_after(hinted) == pytest.approx(0.7)
    assert all(jittered.delay(1, hinted) >= 0.7 for _ in range(50))
    assert jittered.delay(7, hinted) >= 0.8 * 2.0  # the backoff when it is longer than the hint


def test_what_is_retryable() -> None:
    assert is_retryable(LossheadError(C.UNAVAILABLE, "x"))
    assert is_retryable(LossheadError(C.RESOURCE_EXHAUSTED, "x", retry_after_ms=5))
    assert not is_retryable(LossheadError(C.RESOURCE_EXHAUSTED, "too large"))
    for code in (C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED,
                 C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.INTERNAL):
        assert not is_retryable(LossheadError(code, "x", retry_after_ms=5))


# -- backpressure ----------------------------------------------------------------------------
MB_BYTES = 8192  # --max_microbatch_bytes


@pytest.fixture
def tight_server(servers: ServerFactory) -> str:
    """Room for one micro-batch at a time (and two micro-batches' bytes); retry hint 5 ms."""
    return servers.start("--max_inflight_microbatches=1", f"--max_microbatch_bytes={MB_BYTES}",
                         f"--max_inflight_bytes={2 * MB_BYTES}", "--retry_after=5ms").address


class _Holder:
    """A raw Step stream that sends a header and half a micro-batch, then waits: the micro-batch
    holds the server's only admission until the stream is cancelled."""

    def __init__(self, client: Client, head: str, d: int) -> None:
        n = 8
        header = pb.StepHeader(head=head, client_id="holder", sequence=1, num_tokens=n,
                               hidden_dtype=pb.DTYPE_FP32, target_dtype=pb.DTYPE_INT64)
        self._release = threading.Event()

        def requests():
            yield pb.StepRequest(header=header, hidden=b"\0" * (n * d * 4 // 2))
            self._release.wait()

        self._call = client._stub.Step(requests())

    def release(self) -> None:
        self._call.cancel()
        self._release.set()


def _wait_admitted(client: Client, count: int) -> None:
    deadline = time.monotonic() + 5
    while client.stats().admitted_microbatches != count:
        assert time.monotonic() < deadline, "admission count never reached"
        time.sleep(0.005)


def test_refusal_with_hint_is_retried_until_room_frees(tight_server: str) -> None:
    v, d, n = 20, 16, 12
    hidden, weight, targets = random_problem(n, d, v, seed=21)
    with Client(tight_server, client_id="admin") as admin:
        admin.create_head("bp", v, d, weight_dtype=torch.float32)
        admin.upload_weights("bp", weight)
        holder = _Holder(admin, "bp", d)
        _wait_admitted(admin, 1)
        # Without retries the refusal surfaces with the server's hint.
        with Client(tight_server, retry=NO_RETRY) as once:
            with pytest.raises(LossheadError) as e:
                once.step("bp", hidden, targets, reduction="sum")
        assert e.value.code == C.RESOURCE_EXHAUSTED and e.value.retry_after_ms == 5
        assert e.value.sequence is not None and "retry after" in e.value.message
        assert once.retries == 0
        # With retries the step waits for room: refused while the holder holds, then computed.
        with Client(tight_server, client_id="patient", retry=PATIENT) as patient:
            result: List[object] = []
            t = threading.Thread(target=lambda: result.append(
                patient.step("bp", hidden, targets, reduction="sum")))
            t.start()
            time.sleep(0.25)
            refused_while_held = patient.retries
            holder.release()
            t.join(10)
            assert not t.is_alive()
        assert refused_while_held >= 3, refused_while_held
        r = result[0]
        assert not r.replayed and r.token_count == n
        ref = reference(hidden, weight, targets, reduction="sum")
        pulled = admin.pull_gradient("bp", reset=True)
        assert (pulled.summary.microbatch_count, pulled.summary.token_count) == (1, n)
        assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW counted once")
        stats = admin.stats()
        assert (stats.admitted_microbatches, stats.reserved_bytes) == (0, 0)


def test_hintless_resource_exhausted_is_not_retried(tight_server: str) -> None:
    d = 16
    # Over --max_microbatch_bytes: a limit no retry can pass (no hint).
    with Client(tight_server) as c:
        c.create_head("big", 8, d, weight_dtype=torch.float32)
        n = MB_BYTES // (d * 4) + 1  # one token over --max_microbatch_bytes
        with pytest.raises(LossheadError) as e:
            c.step("big", torch.randn(n, d), torch.zeros(n, dtype=torch.long))
        assert e.value.code == C.RESOURCE_EXHAUSTED and e.value.retry_after_ms == 0
        assert c.retries == 0
        assert c.get_head("big").microbatches_total == 0


def test_concurrent_steps_under_backpressure_count_exactly_once(tight_server: str) -> None:
    v, d = 40, 24
    weight = random_problem(1, d, v, seed=30)[1]
    n_clients, per_client = 4, 6
    work = [[random_problem(8 + 5 * ((c + k) % 6), d, v, seed=100 * c + k, ignore_fraction=0.1)
             for k in range(per_client)] for c in range(n_clients)]
    with Client(tight_server, client_id="admin") as admin:
        admin.create_head("busy", v, d, weight_dtype=torch.float32)
        admin.upload_weights("busy", weight)
        clients = [Client(tight_server, client_id=f"trainer-{c}", retry=PATIENT)
                   for c in range(n_clients)]
        results: List[List[object]] = [[] for _ in range(n_clients)]
        errors: List[BaseException] = []

        def train(c: int) -> None:
            try:
                mbs = [clients[c].microbatch("busy", h, t, reduction="sum")
                       for h, _, t in work[c]]
                results[c] = clients[c].run_microbatches(mbs, streams=2)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=train, args=(c,)) for c in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
        assert not errors, errors
        retries = sum(c.retries for c in clients)
        assert retries > 0  # 8 streams against room for one: refusals did happen
        grad = torch.zeros(v, d, dtype=torch.float64)
        tokens = 0
        for c in range(n_clients):
            assert len(results[c]) == per_client
            for (h, _, t), r in zip(work[c], results[c]):
                ref = reference(h, weight, t, reduction="sum")
                assert not r.replayed and r.token_count == ref.token_count
                assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
                grad += ref.grad_weight
                tokens += ref.token_count
        pulled = admin.pull_gradient("busy", reset=True)
        assert pulled.summary.microbatch_count == n_clients * per_client
        assert pulled.summary.token_count == tokens
        assert_close(pulled.grad, grad, FP32_REL, "summed dW")
        info = admin.get_head("busy")
        assert info.microbatches_total == n_clients * per_client and info.tokens_total == tokens
        stats = admin.stats()
        assert (stats.admitted_microbatches, stats.reserved_bytes) == (0, 0)


# -- UNAVAILABLE across restarts, checkpoints and progress -----------------------------------
def _restart_later(servers: ServerFactory, flags: List[str], port: int, delay: float
                   ) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), servers.spawn(*flags, port=port)))
    t.start()
    return t


def test_unavailable_is_retried_across_restarts_with_checkpoints(servers: ServerFactory,
                                                                 tmp_path) -> None:
    v, d = 30, 16
    flags = [f"--checkpoint_dir={tmp_path / 'ckpt'}", "--checkpoint_interval=0"]
    (tmp_path / "ckpt").mkdir()
    first = servers.start(*flags)
    port = first.port
    batches = [random_problem(10 + k, d, v, seed=40 + k) for k in range(6)]
    weight = batches[0][1]
    c = Client(first.address, client_id="resumable", retry=PATIENT)
    with c:
        with pytest.raises(LossheadError) as e:
            c.client_progress("lm")
        assert e.value.code == C.NOT_FOUND
        c.create_head("lm", v, d, weight_dtype=torch.float32)
        c.upload_weights("lm", weight)
        mbs = [c.microbatch("lm", h, t, reduction="sum") for h, _, t in batches]
        assert [m.header.sequence for m in mbs] == [1, 2, 3, 4, 5, 6]
        c.run_microbatches(mbs[:3], max_inflight=1)
        progress = c.client_progress("lm")
        assert (progress.acknowledged_sequence, progress.persisted_sequence) == (3, None)
        (ck,) = c.checkpoint("lm")
        assert ck.head == "lm" and ck.weights_version == 2 and ck.microbatches_since_pull == 3
        assert ck.bytes > v * d * 8 and ck.write_seconds >= 0
        assert [(p.client_id, p.persisted_sequence) for p in ck.clients] == [("resumable", 3)]
        assert [h.head for h in c.checkpoint()] == ["lm"]
        c.step("lm", batches[3][0], batches[3][2], reduction="sum", sequence=4)
        progress = c.client_progress("lm")
        assert (progress.acknowledged_sequence, progress.persisted_sequence) == (4, 3)
        assert c.retries == 0

        # kill -9 loses micro-batch 4; a unary call waits through the restart.
        first.stop(signal.SIGKILL)
        restart = _restart_later(servers, flags, port, 0.3)
        info = c.get_head("lm")
        restart.join()
        assert c.retries > 0, "the restart was not noticed"
        assert (info.microbatches_since_pull, info.weights_version) == (3, 2)
        progress = c.client_progress("lm")
        assert (progress.acknowledged_sequence, progress.persisted_sequence) == (3, 3)
        # Resume rule: resend above persisted; a resend at or below it is a replay.
        replay = c.step("lm", batches[2][0], batches[2][2], reduction="sum", sequence=3)
        assert replay.replayed
        assert not c.step("lm", batches[3][0], batches[3][2], reduction="sum",
                          sequence=4).replayed

        (ck,) = c.checkpoint("lm")
        assert [p.persisted_sequence for p in ck.clients] == [4]

        # Step micro-batches are re-sent on new streams until the server is back; the one the
        # checkpoint holds is replayed, the others computed.
        before = c.retries
        servers.started[-1].stop(signal.SIGKILL)
        restart = _restart_later(servers, flags, port, 0.3)
        results = c.run_microbatches(mbs[3:], streams=2)
        restart.join()
        assert c.retries > before
        assert [(r.sequence, r.replayed) for r in results] == [(4, True), (5, False), (6, False)]
        c.checkpoint("lm")

        # A resetting pull waits for the connection before its single attempt.
        before = c.retries
        servers.started[-1].stop(signal.SIGKILL)
        restart = _restart_later(servers, flags, port, 0.3)
        pulled = c.pull_gradient("lm", reset=True)
        restart.join()
        assert c.retries > before
        ref = reference(torch.cat([b[0] for b in batches]), weight,
                        torch.cat([b[2] for b in batches]), reduction="sum")
        assert pulled.summary.microbatch_count == 6
        assert pulled.summary.token_count == ref.token_count
        assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW: each micro-batch once")


def test_checkpoint_without_checkpoint_dir(client: Client, make_head) -> None:
    name = make_head(4, 4)
    with pytest.raises(LossheadError) as e:
        client.checkpoint(name)
    assert e.value.code == C.FAILED_PRECONDITION
    progress = client.client_progress(name, "nobody")
    assert progress.client_id == "nobody"
    assert (progress.acknowledged_sequence, progress.persisted_sequence) == (None, None)


# -- lost answers: what is re-sent and what is not -------------------------------------------
class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: connection lost after the server answered"


class _LostStream:
    """Answers of a server-streaming call that completed on the server but never arrive."""

    def __init__(self, call) -> None:
        for _ in call:  # the server did all of its work...
            pass

    def __iter__(self):
        return self

    def __next__(self):
        raise _Unavailable()  # ...but the client hears only that the connection dropped

    def cancel(self) -> bool:
        return True


class _LostResponse:
    def __init__(self, outcome) -> None:
        outcome.result()  # the push landed...

    def result(self, timeout=None):
        raise _Unavailable()  # ...and its answer was lost


class _LoseAnswers(grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Loses the answer of the next `budget` PullGradient / PushWeights calls; counts calls."""

    def __init__(self) -> None:
        self.budget = 0
        self.calls = 0

    def intercept_unary_stream(self, continuation, details, request):
        call = continuation(details, request)
        if not details.method.endswith("/PullGradient"):
            return call
        self.calls += 1
        if self.budget:
            self.budget -= 1
            return _LostStream(call)
        return call

    def intercept_stream_unary(self, continuation, details, request_iterator):
        outcome = continuation(details, request_iterator)
        self.calls += 1
        if self.budget:
            self.budget -= 1
            return _LostResponse(outcome)
        return outcome


@pytest.fixture
def lossy(server_address: str):
    interceptor = _LoseAnswers()
    channel = grpc.intercept_channel(grpc.insecure_channel(server_address), interceptor)
    with Client(server_address, channel=channel, client_id="lossy") as c:
        yield c, interceptor


def test_reset_pull_is_never_resent(client: Client, make_head, lossy) -> None:
    flaky, lose = lossy
    n, d, v = 12, 8, 10
    hidden, weight, targets = random_problem(n, d, v, seed=50)
    name = make_head(v, d, weights=weight)
    client.step(name, hidden, targets, reduction="sum")
    # Without reset a lost answer is simply asked again.
    lose.budget, lose.calls = 1, 0
    pulled = flaky.pull_gradient(name)
    assert (lose.calls, flaky.retries) == (2, 1)
    assert pulled.summary.token_count == n
    # With reset the lost answer is reported, not asked again: the window is gone with it, and
    # the head says so.
    lose.budget, lose.calls = 1, 0
    with pytest.raises(LossheadError) as e:
        flaky.pull_gradient(name, reset=True)
    assert e.value.code == C.UNAVAILABLE
    assert (lose.calls, flaky.retries) == (1, 1)
    assert client.get_head(name).tokens_since_pull == 0


def test_push_resent_only_where_a_repeat_cannot_add_twice(client: Client, make_head,
                                                          lossy) -> None:
    flaky, lose = lossy
    name = make_head(6, 4)
    w = torch.randn(6, 4)
    # REPLACE: re-sent whole; W is the same either way.
    lose.budget, lose.calls = 1, 0
    assert flaky.upload_weights(name, w) == 3  # both attempts landed: versions 2 and 3
    assert lose.calls == 2 and flaky.retries == 1
    # ADD without an expected version: never re-sent.
    lose.budget, lose.calls = 1, 0
    with pytest.raises(LossheadError) as e:
        flaky.push_weights(name, torch.ones(6, 4), add=True)
    assert e.value.code == C.UNAVAILABLE and lose.calls == 1
    # ADD with an expected version: re-sent, and the repeat of a delta that landed is refused.
    lose.budget, lose.calls = 1, 0
    with pytest.raises(LossheadError) as e:
        flaky.push_weights(name, torch.ones(6, 4), add=True, expected_weights_version=4)
    assert e.value.code == C.FAILED_PRECONDITION and lose.calls == 2
    down = client.download_weights(name)
    assert down.version == 5
    assert_close(down.weights, w + 2, 1e-6, "each delta added once")
