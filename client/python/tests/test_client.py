"""Client against a CPU-backend server: heads, transfers, steps, streams, idempotent retries."""

from __future__ import annotations

import contextlib
import time
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from _reference import assert_close, random_problem, reference
from _servers import CUDA_TF32_REL, device_count, devices_flag, on_cuda, server_backend
from losshead import Client, LossheadError, LossOptions, RetryPolicy, StepStream
from losshead import native_available, native_library
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._proto.losshead.v1 import losshead_pb2_grpc as pb_grpc

# The CPU backend computes in fp32 from fp32 inputs: errors are at fp32 rounding level.
FP32_REL = 2e-5


def test_health_and_stats(client: Client) -> None:
    assert client.health() == "SERVING"
    stats = client.stats()
    assert stats.device.backend == server_backend()
    assert stats.max_message_bytes >= 1 << 20


def test_head_lifecycle(client: Client, make_head) -> None:
    name = make_head(17, 8, dtype=torch.bfloat16, init_std=0.02, seed=7)
    info = client.get_head(name)
    assert (info.spec.vocab_size, info.spec.hidden_size) == (17, 8)
    assert info.spec.weight_dtype == pb.DTYPE_BF16
    assert info.weights_version == 1
    assert name in [h.spec.name for h in client.list_heads()]
    info = client.set_loss_options(name, LossOptions(ignore_index=3, label_smoothing=0.25))
    assert info.spec.default_options.ignore_index == 3
    assert info.spec.default_options.label_smoothing == pytest.approx(0.25)
    client.delete_head(name)
    with pytest.raises(LossheadError) as e:
        client.get_head(name)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_normal_init_is_seeded(client: Client, make_head) -> None:
    a = make_head(64, 32, init_std=0.5, seed=11)
    b = make_head(64, 32, init_std=0.5, seed=11)
    wa = client.download_weights(a).weights
    wb = client.download_weights(b).weights
    assert torch.equal(wa, wb)
    assert 0.4 < float(wa.std()) < 0.6


def test_weights_round_trip_in_chunks(client: Client, make_head) -> None:
    # 3000 x 512 fp32 = 6 MiB: more than one message each way.
    v, d = 3000, 512
    name = make_head(v, d)
    w = torch.randn(v, d)
    version = client.upload_weights(name, w)
    assert version == 2
    down = client.download_weights(name)
    assert down.version == 2 and torch.equal(down.weights, w)
    delta = torch.randn(v, d)
    assert client.push_weights(name, delta, add=True, expected_weights_version=2) == 3
    assert_close(client.download_weights(name).weights, w + delta, 1e-6, "W + delta")
    # The gradient of an untouched head is zero and pulls whole.
    pulled = client.pull_gradient(name)
    assert pulled.grad.shape == (v, d) and not pulled.grad.any()
    assert pulled.summary.token_count == 0


def test_bf16_head_rounds_like_torch(client: Client, make_head) -> None:
    name = make_head(40, 24, dtype=torch.bfloat16)
    w = torch.randn(40, 24)
    client.upload_weights(name, w)  # fp32 on the wire, rounded by the server
    down = client.download_weights(name)
    assert down.weights.dtype == torch.bfloat16
    assert torch.equal(down.weights, w.to(torch.bfloat16))
    as_fp32 = client.download_weights(name, dtype=torch.float32).weights
    assert torch.equal(as_fp32, w.to(torch.bfloat16).float())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    {},
    {"ignore_index": -100},
    {"ignore_index": 5, "label_smoothing": 0.1},
    {"z_loss": 1e-3, "logit_softcap": 3.0},
], ids=["plain", "ignore", "ignore5_smooth", "zloss_softcap"])
def test_step_matches_torch_fp32(client: Client, make_head, reduction: str, options: dict) -> None:
    n, d, v = 96, 48, 131
    ignore = options.get("ignore_index", -100)
    seed = zlib.crc32(f"{reduction}{sorted(options.items())}".encode())
    hidden, weight, targets = random_problem(n, d, v, seed=seed,
                                             ignore_fraction=0.2 if "ignore_index" in options
                                             else 0.0, ignore_index=ignore)
    name = make_head(v, d, weights=weight)
    r = client.step(name, hidden, targets, reduction=reduction, return_per_token_loss=True,
                    loss_options=LossOptions(**options))
    ref = reference(hidden, weight, targets, reduction=reduction, **options)
    assert r.token_count == ref.token_count
    assert not r.replayed and r.weights_version == 2  # 1 at creation, 2 after the upload
    assert r.loss_sum == pytest.approx(float(ref.per_token.sum()), rel=FP32_REL)
    expected_loss = ref.loss.sum() if reduction == "none" else ref.loss
    assert r.loss == pytest.approx(float(expected_loss), rel=FP32_REL)
    assert_close(r.per_token_loss, ref.per_token, FP32_REL, "per-token loss")
    assert r.grad_hidden.dtype == torch.float32
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
    pulled = client.pull_gradient(name, reset=True)
    assert pulled.summary.token_count == ref.token_count
    assert pulled.summary.microbatch_count == 1
    assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW")


_PRECISIONS = {None: pb.MATMUL_PRECISION_HIGHEST, "highest": pb.MATMUL_PRECISION_HIGHEST,
               "high": pb.MATMUL_PRECISION_HIGH, "medium": pb.MATMUL_PRECISION_MEDIUM}


@pytest.mark.parametrize("precision", list(_PRECISIONS), ids=str)
def test_fp32_head_matmul_precision_reported_and_step_matches_torch(client: Client, make_head,
                                                                    precision) -> None:
    """An fp32 head keeps the precision it was created with (unset reads HIGHEST); the CPU
    backend computes as "highest" whatever the head allows, so the results are fp32's (a CUDA
    server's at "high" and "medium" are TF32's)."""
    n, d, v = 80, 40, 75
    hidden, weight, targets = random_problem(n, d, v, seed=zlib.crc32(str(precision).encode()),
                                             ignore_fraction=0.1)
    name = make_head(v, d, weights=weight, matmul_precision=precision)
    info = client.get_head(name)
    assert info.spec.matmul_precision == _PRECISIONS[precision]
    assert [h.spec.matmul_precision for h in client.list_heads() if h.spec.name == name] == [
        _PRECISIONS[precision]]
    rel = CUDA_TF32_REL if on_cuda() and precision in ("high", "medium") else FP32_REL
    r = client.step(name, hidden, targets, reduction="sum", return_per_token_loss=True)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.token_count == ref.token_count
    assert r.loss == pytest.approx(float(ref.loss), rel=rel)
    assert_close(r.per_token_loss, ref.per_token, rel, "per-token loss")
    assert_close(r.grad_hidden, ref.grad_hidden, rel, "dH")
    assert_close(client.pull_gradient(name).grad, ref.grad_weight, rel, "dW")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_half_head_refuses_reduced_matmul_precision(client: Client, make_head, dtype,
                                                    precision: str) -> None:
    name = f"refused-{precision}-{str(dtype).rsplit('.', 1)[1]}"
    try:
        with pytest.raises(LossheadError) as e:
            client.create_head(name, 16, 8, weight_dtype=dtype, matmul_precision=precision)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert e.value.sequence is None
        with pytest.raises(LossheadError) as missing:
            client.get_head(name)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        assert name not in [h.spec.name for h in client.list_heads()]
    finally:
        with contextlib.suppress(LossheadError):
            client.delete_head(name)
    # What they compute in already: accepted, as is leaving it unset.
    for asked in ("highest", None):
        kept = make_head(16, 8, dtype=dtype, matmul_precision=asked)
        assert client.get_head(kept).spec.matmul_precision == pb.MATMUL_PRECISION_HIGHEST


class _CountCalls(grpc.UnaryUnaryClientInterceptor):
    def __init__(self) -> None:
        self.methods: list = []

    def intercept_unary_unary(self, continuation, client_call_details, request):
        self.methods.append(client_call_details.method)
        return continuation(client_call_details, request)


@pytest.mark.parametrize("precision", ["HIGH", "tf32", "", "bf16", pb.MATMUL_PRECISION_HIGH,
                                       ["high"]], ids=repr)
def test_unknown_matmul_precision_raises_before_any_call(server_address: str, client: Client,
                                                         precision) -> None:
    counter = _CountCalls()
    channel = grpc.intercept_channel(grpc.insecure_channel(server_address), counter)
    with Client(server_address, channel=channel) as c:
        with pytest.raises(ValueError, match="^losshead: matmul_precision must be 'highest', "
                                             "'high' or 'medium'"):
            c.create_head("never", 16, 8, weight_dtype=torch.float32,
                          matmul_precision=precision)
    assert counter.methods == []
    with pytest.raises(LossheadError) as e:
        client.get_head("never")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_matmul_precision_survives_a_restart_from_checkpoints(servers, tmp_path) -> None:
    flags = [f"--checkpoint_dir={tmp_path / 'ckpt'}", "--checkpoint_interval=0"]
    (tmp_path / "ckpt").mkdir()
    first = servers.start(*flags)
    asked = {"unset": None, "high": "high", "medium": "medium"}
    with Client(first.address, client_id="precise") as c:
        for name, precision in asked.items():
            c.create_head(name, 12, 8, weight_dtype=torch.float32, matmul_precision=precision)
        assert sorted(h.head for h in c.checkpoint()) == sorted(asked)
    first.stop()
    second = servers.start(*flags)
    with Client(second.address, client_id="precise") as c:
        for name, precision in asked.items():
            assert c.get_head(name).spec.matmul_precision == _PRECISIONS[precision], name


def test_step_bf16_wire_and_grad_scale(client: Client, make_head) -> None:
    n, d, v = 64, 32, 100
    hidden, weight, targets = random_problem(n, d, v, seed=3)
    name = make_head(v, d, weights=weight)
    r = client.step(name, hidden, targets, hidden_dtype=torch.bfloat16, reduction="sum",
                    grad_scale=0.5)
    assert r.grad_hidden.dtype == torch.bfloat16
    ref = reference(hidden.to(torch.bfloat16), weight, targets, reduction="sum",
                    upstream=torch.tensor(0.5))
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, 2 ** -8, "dH (bf16)")
    assert_close(client.pull_gradient(name).grad, ref.grad_weight, FP32_REL, "dW")


def test_large_microbatch_is_framed_in_pieces(client: Client, make_head) -> None:
    # 2048 x 768 fp32 = 6 MiB up and 6 MiB of dH down: several messages each way.
    n, d, v = 2048, 768, 64
    hidden, weight, targets = random_problem(n, d, v, seed=4)
    name = make_head(v, d, weights=weight)
    r = client.step(name, hidden, targets, reduction="sum")
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")


def test_step_stream_pipelines_in_order(client: Client, make_head) -> None:
    d, v = 32, 77
    name = make_head(v, d, weights=random_problem(1, d, v, seed=5)[1])
    weight = client.download_weights(name).weights
    batches = [random_problem(20 + 7 * i, d, v, seed=50 + i)[::2]  # (hidden, targets)
               for i in range(6)]
    results = list(client.step_stream(name, batches, max_inflight=3, reduction="sum"))
    assert [r.sequence for r in results] == sorted(r.sequence for r in results)
    grad = torch.zeros(v, d, dtype=torch.float64)
    for (h, t), r in zip(batches, results):
        ref = reference(h, weight, t, reduction="sum")
        assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
        assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
        grad += ref.grad_weight
    pulled = client.pull_gradient(name, reset=True)
    assert pulled.summary.microbatch_count == 6
    assert_close(pulled.grad, grad, FP32_REL, "accumulated dW")


def test_step_chunked_equals_one_step(client: Client, make_head) -> None:
    n, d, v = 1000, 40, 90
    hidden, weight, targets = random_problem(n, d, v, seed=6, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    r = client.step_chunked(name, hidden, targets, chunk_tokens=128, streams=3,
                            return_per_token_loss=True)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.token_count == ref.token_count
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
    assert_close(r.per_token_loss, ref.per_token, FP32_REL, "per-token loss")
    info = client.get_head(name)
    assert info.microbatches_since_pull == 8 and info.tokens_since_pull == ref.token_count
    assert_close(client.pull_gradient(name).grad, ref.grad_weight, FP32_REL, "dW")
    with pytest.raises(ValueError):
        client.step_chunked(name, hidden, targets, reduction="mean")


def test_retry_with_same_sequence_is_replayed(client: Client, make_head) -> None:
    n, d, v = 50, 16, 33
    hidden, weight, targets = random_problem(n, d, v, seed=7)
    name = make_head(v, d, weights=weight)
    first = client.step(name, hidden, targets, reduction="sum")
    dw = client.pull_gradient(name).grad
    again = client.step(name, hidden, targets, reduction="sum", sequence=first.sequence)
    assert again.replayed and not first.replayed
    assert again.sequence == first.sequence
    assert again.loss == first.loss and again.token_count == first.token_count
    assert torch.equal(again.grad_hidden, first.grad_hidden)
    info = client.get_head(name)
    assert info.microbatches_since_pull == 1 and info.tokens_since_pull == n
    assert torch.equal(client.pull_gradient(name).grad, dw)


def test_forward_only_step_equals_a_counted_step_and_counts_nothing(client: Client,
                                                                     make_head) -> None:
    n, d, v = 60, 24, 70
    hidden, weight, targets = random_problem(n, d, v, seed=8, ignore_fraction=0.2)
    name = make_head(v, d, weights=weight)
    counted = client.step(name, hidden, targets, reduction="sum", return_per_token_loss=True)
    before = client.pull_gradient(name)
    info_before = client.get_head(name)
    # Reusing the counted step's key: forward-only is never answered from the replay cache.
    fwd = client.step(name, hidden, targets, reduction="sum", return_per_token_loss=True,
                      forward_only=True, sequence=counted.sequence)
    assert fwd.forward_only and not fwd.replayed and not counted.forward_only
    assert (fwd.loss, fwd.loss_sum, fwd.token_count, fwd.weights_version) == (
        counted.loss, counted.loss_sum, counted.token_count, counted.weights_version)
    assert torch.equal(fwd.grad_hidden, counted.grad_hidden)
    assert torch.equal(fwd.per_token_loss, counted.per_token_loss)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert fwd.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    loss_only = client.step(name, hidden, targets, forward_only=True, skip_grad_hidden=True)
    assert loss_only.grad_hidden is None
    assert loss_only.loss == pytest.approx(float(ref.loss) / ref.token_count, rel=FP32_REL)
    after = client.pull_gradient(name)
    assert torch.equal(after.grad, before.grad) and after.summary == before.summary
    info = client.get_head(name)
    assert (info.tokens_total, info.microbatches_total) == (info_before.tokens_total,
                                                            info_before.microbatches_total)
    # The counted step's key still replays the counted answer.
    again = client.step(name, hidden, targets, reduction="sum", return_per_token_loss=True,
                        sequence=counted.sequence)
    assert again.replayed and again.loss_sum == counted.loss_sum


class _ServerWithoutForwardOnly(pb_grpc.LossHeadServicer):
    """Answers every micro-batch as a server that predates StepOptions.forward_only does."""

    def Step(self, requests, context):  # type: ignore[no-untyped-def]
        for req in requests:
            if req.HasField("header"):
                header = req.header
            if req.last:
                yield pb.StepResponse(
                    client_id=header.client_id, sequence=header.sequence, last=True,
                    result=pb.StepResult(loss=1.0, loss_sum=1.0, token_count=1,
                                         weights_version=1))


def test_forward_only_on_a_server_without_it_raises() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_LossHeadServicer_to_server(_ServerWithoutForwardOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}") as c:
            hidden, targets = torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64)
            assert not c.step("old", hidden, targets).forward_only
            with pytest.raises(LossheadError) as e:
                c.step("old", hidden, targets, forward_only=True)
            assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
            assert "forward_only" in e.value.message
    finally:
        server.stop(None)


class _CancellingServer(pb_grpc.LossHeadServicer):
    """Cancels every call it receives, as gRPC's server does with calls that reach it while it
    shuts down."""

    def __init__(self) -> None:
        self.stats_calls = 0
        self.step_calls = 0

    def GetStats(self, request, context):  # type: ignore[no-untyped-def]
        self.stats_calls += 1
        context.cancel()
        return pb.Stats()

    def Step(self, requests, context):  # type: ignore[no-untyped-def]
        self.step_calls += 1
        context.cancel()
        return iter(())


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_available(), reason=f"no native library: {native_library()}"))])
def test_calls_the_server_cancelled_are_unavailable_and_retried(native: bool) -> None:
    servicer = _CancellingServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_LossHeadServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.001, jitter=0)
    try:
        with Client(f"127.0.0.1:{port}", retry=retry, native=native) as c:
            with pytest.raises(LossheadError) as e:
                c.stats()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            assert "CANCELLED" in e.value.message
            assert servicer.stats_calls == 3
            hidden, targets = torch.randn(2, 4), torch.randint(0, 8, (2,))
            with pytest.raises(LossheadError) as e:
                c.step("h", hidden, targets)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            # The native client also asks GetStats once per stream whether the server shares its
            # host (the same-node path): only the Steps are counted here.
            assert servicer.step_calls == 3
    finally:
        server.stop(None)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: connection lost after the server answered"


class _LostAnswers:
    """A Step call whose answers are lost after the server computed the first micro-batch."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self):
        return self

    def __next__(self):
        if self._call is not None:
            for response in self._call:  # the micro-batch is computed and counted...
                if response.last:
                    break
            self._call.cancel()
            self._call = None
        raise _Unavailable()  # ...but its answer never reaches the client

    def cancel(self) -> bool:
        if self._call is not None:
            self._call.cancel()
        return True


class _DropFirstStepAnswer(grpc.StreamStreamClientInterceptor):
    """Loses the answers of the first Step call, as a dropped connection would."""

    def __init__(self) -> None:
        self.dropped = 0

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        call = continuation(client_call_details, request_iterator)
        if self.dropped or not client_call_details.method.endswith("/Step"):
            return call
        self.dropped += 1
        return _LostAnswers(call)


def test_client_retries_lost_answer_without_double_counting(server_address: str,
                                                            client: Client, make_head) -> None:
    n, d, v = 40, 16, 21
    hidden, weight, targets = random_problem(n, d, v, seed=8)
    name = make_head(v, d, weights=weight)
    interceptor = _DropFirstStepAnswer()
    channel = grpc.intercept_channel(grpc.insecure_channel(server_address), interceptor)
    with Client(server_address, channel=channel, client_id="retrying") as flaky:
        r = flaky.step(name, hidden, targets, reduction="sum")
    assert interceptor.dropped == 1
    assert r.replayed  # the resend found the first attempt already counted
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH of the replay")
    pulled = client.pull_gradient(name)
    assert pulled.summary.microbatch_count == 1 and pulled.summary.token_count == n
    assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW counted once")


def test_raw_step_stream_answers_each_microbatch(client: Client, make_head) -> None:
    d, v = 8, 10
    name = make_head(v, d)
    with StepStream(client) as stream:
        mbs = [client.microbatch(name, torch.randn(4, d), torch.randint(0, v, (4,)))
               for _ in range(3)]
        for mb in mbs:
            stream.submit(mb)
        got = [stream.receive().sequence for _ in mbs]
    assert got == [mb.header.sequence for mb in mbs]


def test_chunks_over_several_connections(server_address: str, make_head) -> None:
    n, d, v = 600, 32, 70
    hidden, weight, targets = random_problem(n, d, v, seed=9, ignore_fraction=0.1)
    name = make_head(v, d, weights=weight)
    with Client(server_address, connections=3) as c:
        r = c.step_chunked(name, hidden, targets, chunk_tokens=50, streams=6)
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.token_count == ref.token_count
    assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")


def test_sharded_head_matches_the_reference(servers) -> None:
    """A head sharded by vocabulary rows over the three (CPU) devices of a server: every chunk
    runs on all shards, which combine their softmax statistics; loss, dH and dW are the float64
    reference's, and W comes back whole."""
    server = servers.start(devices_flag(device_count(3)))
    n, d, v = 500, 24, 61  # 61 rows: shards hold 20, 20 and 21
    hidden, weight, targets = random_problem(n, d, v, seed=9, ignore_fraction=0.1)
    with Client(server.address, client_id="sharded") as c:
        info = c.create_head("shard", v, d, weight_dtype=torch.float32, shards=0)
        assert info.spec.placement.kind == pb.PLACEMENT_SHARDED
        assert [m.weights_bytes for m in info.device_memory] == [20 * d * 4, 20 * d * 4, 21 * d * 4]
        c.upload_weights("shard", weight)
        assert torch.equal(c.download_weights("shard").weights, weight)
        r = c.step_chunked("shard", hidden, targets, chunk_tokens=64, streams=3)
        ref = reference(hidden, weight, targets, reduction="sum")
        assert r.token_count == ref.token_count
        assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
        assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
        pulled = c.pull_gradient("shard", reset=True)
        assert pulled.summary.microbatch_count == 8
        assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW")
        with pytest.raises(ValueError):
            c.create_head("both", v, d, replicas=2, shards=2)


def test_replicated_head_matches_the_reference(servers) -> None:
    """A head replicated over the three (CPU) devices of a server: chunks run on every replica
    from several streams, and the reduced window is the float64 sum."""
    server = servers.start(devices_flag(device_count(3)))
    n, d, v = 600, 24, 61  # 61 rows: replicas own 20, 20 and 21
    hidden, weight, targets = random_problem(n, d, v, seed=8, ignore_fraction=0.1)
    with Client(server.address, client_id="replicated") as c:
        info = c.create_head("rep", v, d, weight_dtype=torch.float32, replicas=0)
        assert len(info.devices) == 3 and info.spec.placement.devices == 3
        c.upload_weights("rep", weight)
        r = c.step_chunked("rep", hidden, targets, chunk_tokens=64, streams=3)
        ref = reference(hidden, weight, targets, reduction="sum")
        assert r.token_count == ref.token_count
        assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
        assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
        pulled = c.pull_gradient("rep", reset=True)
        assert pulled.summary.microbatch_count == 10
        assert_close(pulled.grad, ref.grad_weight, FP32_REL, "dW")
        assert all(m.workspace_bytes > 0 for m in c.get_head("rep").device_memory)
        with pytest.raises(LossheadError) as refused:
            c.create_head("four", v, d, replicas=4)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _connections_to(port: int) -> int:
    """This machine's established TCP connections to `port` (client ends only); gRPC's sockets
    are IPv6 ones with IPv4-mapped loopback addresses, so both tables count."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as table:
            next(table)
            for row in table:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


def _settled_connections(port: int, expected: int, timeout: float = 5.0) -> int:
    """The count once it equals `expected`, or whatever it is after `timeout` (connections
    open and close asynchronously)."""
    deadline = time.monotonic() + timeout
    while (got := _connections_to(port)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="needs Linux's /proc/net/tcp*")
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_available(), reason=f"no native library: {native_library()}"))])
def test_each_step_stream_gets_a_connection_of_its_own(servers, native: bool) -> None:
    """By default a Client opens one TCP connection per Step stream, as a call first needs them,
    and keeps them for the next call; `connections=k` caps them at k. The results are the
    reference's either way."""
    server = servers.start()
    n, d, v = 700, 16, 50
    hidden, weight, targets = random_problem(n, d, v, seed=31, ignore_fraction=0.1)
    ref = reference(hidden, weight, targets, reduction="sum")

    def step(c: Client, streams: int) -> None:
        r = c.step_chunked("h", hidden, targets, chunk_tokens=100, streams=streams)
        assert r.loss == pytest.approx(float(ref.loss), rel=FP32_REL)
        assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")

    # The control calls' channel, plus, on the native path, the first stream's own client.
    base = 2 if native else 1
    assert _settled_connections(server.port, 0) == 0  # the start-up probe's has closed
    with Client(server.address, native=native) as c:
        c.create_head("h", v, d, weight_dtype=torch.float32)
        c.upload_weights("h", weight)
        step(c, 1)
        assert _connections_to(server.port) == base
        step(c, 3)
        assert _settled_connections(server.port, base + 2) == base + 2
        step(c, 3)
        step(c, 2)
        assert _settled_connections(server.port, base + 2) == base + 2, "kept, not reopened"
    assert _settled_connections(server.port, 0) == 0, "close() closes every connection"
    # A closed client refuses work, whichever path it would take, and opens nothing for it.
    calls = {"step": lambda: c.step("h", hidden[:5], targets[:5]),
             "step_chunked": lambda: step(c, 4),
             "open_step_stream": c.open_step_stream,
             "step_stream": lambda: list(c.step_stream("h", [(hidden[:5], targets[:5])])),
             "get_head": lambda: c.get_head("h"), "health": c.health,
             "download_weights": lambda: c.download_weights("h"),
             "push_weights": lambda: c.push_weights("h", weight),
             "pull_gradient": lambda: c.pull_gradient("h"),
             "pull_gradient(reset)": lambda: c.pull_gradient("h", reset=True)}
    for name, call in calls.items():
        with pytest.raises(LossheadError) as e:
            call()
        assert (e.value.code, str(e.value)) == (
            grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION: the client is closed"), name
    assert _settled_connections(server.port, 0) == 0

    with Client(server.address, native=native, connections=2) as c:
        step(c, 1)  # gRPC connects a channel on its first call: the second is not yet open
        assert _connections_to(server.port) == base
        step(c, 3)
        assert _settled_connections(server.port, base + 1) == base + 1, "capped at 2"
    with pytest.raises(ValueError):
        Client(server.address, connections=0)
