"""Every bad input raises LossheadError with its exact status code and changes nothing."""

from __future__ import annotations

from typing import Callable

import grpc
import pytest
import torch

from losshead import Client, LossheadError, LossOptions, RemoteLMHead
from losshead._proto.losshead.v1 import losshead_pb2 as pb

C = grpc.StatusCode


def _raises(code: grpc.StatusCode, fn: Callable[[], object]) -> LossheadError:
    with pytest.raises(LossheadError) as e:
        fn()
    assert e.value.code == code, f"expected {code.name}, got {e.value}"
    assert e.value.message
    return e.value


@pytest.mark.parametrize("kwargs", [
    {"name": "has space", "vocab_size": 4, "hidden_size": 4},
    {"name": "", "vocab_size": 4, "hidden_size": 4},
    {"name": "x" * 129, "vocab_size": 4, "hidden_size": 4},
    {"name": "ok", "vocab_size": 0, "hidden_size": 4},
    {"name": "ok", "vocab_size": 4, "hidden_size": 0},
    {"name": "ok", "vocab_size": 4, "hidden_size": 4, "weight_dtype": torch.int32},
    {"name": "ok", "vocab_size": 4, "hidden_size": 4, "init_std": 0.0},
    {"name": "ok", "vocab_size": 4, "hidden_size": 4,
     "default_options": LossOptions(label_smoothing=1.0)},
    {"name": "ok", "vocab_size": 4, "hidden_size": 4, "default_options": LossOptions(z_loss=-1)},
], ids=["name_space", "name_empty", "name_long", "vocab0", "hidden0", "dtype_int32", "std0",
        "smoothing1", "zloss_negative"])
def test_create_head_invalid(client: Client, kwargs: dict) -> None:
    _raises(C.INVALID_ARGUMENT, lambda: client.create_head(**kwargs))
    assert "ok" not in [h.spec.name for h in client.list_heads()]


def test_create_head_duplicate_and_too_large(client: Client, make_head) -> None:
    name = make_head(4, 4)
    _raises(C.ALREADY_EXISTS, lambda: client.create_head(name, 8, 8))
    assert client.get_head(name).spec.vocab_size == 4
    # Beyond --max_head_bytes no retry on this server can succeed: INVALID_ARGUMENT.
    _raises(C.INVALID_ARGUMENT, lambda: client.create_head("huge", (1 << 31) - 1, 1 << 30))
    assert "huge" not in [h.spec.name for h in client.list_heads()]


def test_unknown_head_is_not_found(client: Client) -> None:
    for call in [
        lambda: client.get_head("absent"),
        lambda: client.delete_head("absent"),
        lambda: client.set_loss_options("absent", LossOptions()),
        lambda: client.pull_gradient("absent"),
        lambda: client.download_weights("absent"),
        lambda: client.upload_weights("absent", torch.zeros(2, 2)),
        lambda: client.step("absent", torch.randn(2, 4), torch.zeros(2, dtype=torch.long)),
    ]:
        _raises(C.NOT_FOUND, call)


def test_set_loss_options_invalid(client: Client, make_head) -> None:
    name = make_head(4, 4)
    for options in [LossOptions(label_smoothing=1.0), LossOptions(label_smoothing=-0.1),
                    LossOptions(z_loss=-0.5), LossOptions(logit_softcap=-1.0)]:
        _raises(C.INVALID_ARGUMENT, lambda: client.set_loss_options(name, options))
    assert not client.get_head(name).spec.default_options.HasField("label_smoothing")


def _assert_untouched(client: Client, name: str) -> None:
    info = client.get_head(name)
    assert (info.tokens_since_pull, info.microbatches_since_pull, info.weights_version) == (0, 0, 1)
    assert not client.pull_gradient(name).grad.any()


@pytest.mark.parametrize("case", [
    "hidden_size", "target_high", "target_negative", "targets_short", "no_tokens", "hidden_int",
    "target_float", "hidden_nan", "smoothing", "zloss", "grad_dtype_int", "reduction_enum",
], ids=str)
def test_step_invalid_argument(client: Client, make_head, case: str) -> None:
    v, d, n = 11, 8, 6
    name = make_head(v, d, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    kw: dict = {}
    if case == "hidden_size":
        hidden = torch.randn(n, d + 1)
    elif case == "target_high":
        targets[2] = v
    elif case == "target_negative":
        targets[0] = -1
    elif case == "targets_short":
        targets = targets[:-1]
    elif case == "no_tokens":
        hidden, targets = hidden[:0], targets[:0]
    elif case == "hidden_int":
        kw["hidden_dtype"] = torch.int32
    elif case == "target_float":
        kw["target_dtype"] = torch.float32  # targets must be INT32 | INT64
    elif case == "hidden_nan":
        hidden[1, 3] = float("nan")
    elif case == "smoothing":
        kw["loss_options"] = LossOptions(label_smoothing=1.0)
    elif case == "zloss":
        kw["loss_options"] = LossOptions(z_loss=-1.0)
    elif case == "grad_dtype_int":
        kw["grad_hidden_dtype"] = torch.int64
    elif case == "reduction_enum":
        kw["reduction"] = 17
    e = _raises(C.INVALID_ARGUMENT, lambda: client.step(name, hidden, targets, **kw))
    assert e.sequence is not None  # a micro-batch error, reported in its response
    _assert_untouched(client, name)


# What encoding would lose (a tensor's dtype, how targets pair with hidden states) is refused by
# the client before anything is sent: through step, step_chunked and the torch bridge alike.
_LOCAL_CASES = {
    "targets_float": (lambda h, t: (h, t.float()), "targets must be an integer tensor"),
    "targets_bool": (lambda h, t: (h, t > 3), "targets must be an integer tensor"),
    "hidden_int": (lambda h, t: (h.long(), t), "hidden must be a floating-point tensor"),
    "shapes_transposed": (lambda h, t: (h.view(2, 3, -1), t.view(3, 2)), "do not pair"),
    "targets_short": (lambda h, t: (h, t[:-1]), "do not pair"),
}


@pytest.mark.parametrize("entry", ["step", "step_chunked", "bridge", "bridge_eval"])
@pytest.mark.parametrize("case", sorted(_LOCAL_CASES))
def test_inputs_that_encoding_would_lose(client: Client, make_head, case: str,
                                         entry: str) -> None:
    v, d, n = 11, 8, 6
    name = make_head(v, d, init_std=0.1)
    make, reason = _LOCAL_CASES[case]
    hidden, targets = make(torch.randn(n, d), torch.randint(0, v, (n,)))
    if entry == "step" and case in ("shapes_transposed", "targets_short"):
        pytest.skip("step sends one micro-batch as given: the server judges its token count")
    head = RemoteLMHead(client, name, wire_dtype=torch.float32)
    call = {
        "step": lambda: client.step(name, hidden, targets),
        "step_chunked": lambda: client.step_chunked(name, hidden, targets, chunk_tokens=4),
        "bridge": lambda: head(hidden, targets),
        "bridge_eval": lambda: head.evaluate(hidden, targets),
    }[entry]
    e = _raises(C.INVALID_ARGUMENT, call)
    assert reason in e.message and e.sequence is None  # refused locally, before any micro-batch
    _assert_untouched(client, name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("entry", ["step_chunked", "bridge"])
@pytest.mark.parametrize("case", ["nan", "inf", "overflows_fp16_wire"])
def test_nonfinite_hidden_of_a_chunked_batch_is_refused_before_sending(
        client: Client, make_head, case: str, entry: str, device: str) -> None:
    """The server would refuse only the chunk holding it, after counting the others."""
    v, d, n = 11, 8, 40
    name = make_head(v, d, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    hidden[33, 5] = {"nan": float("nan"), "inf": float("-inf"), "overflows_fp16_wire": 7e4}[case]
    hidden, targets = hidden.to(device), targets.to(device)
    wire = torch.float16 if case == "overflows_fp16_wire" else torch.float32
    head = RemoteLMHead(client, name, wire_dtype=wire, chunk_tokens=8, min_chunk_tokens=8,
                        edge_tokens=0, streams=2)
    call = {"step_chunked": lambda: client.step_chunked(name, hidden, targets, chunk_tokens=8,
                                                        hidden_dtype=wire),
            "bridge": lambda: head(hidden.requires_grad_(), targets)}[entry]
    e = _raises(C.INVALID_ARGUMENT, call)
    assert "hidden contains NaN or Inf" in e.message and e.sequence is None
    _assert_untouched(client, name)
    # One micro-batch is the server's to judge, with the same outcome: nothing counted.
    e = _raises(C.INVALID_ARGUMENT, lambda: client.step_chunked(
        name, hidden.detach(), targets, chunk_tokens=n, hidden_dtype=wire))
    assert e.sequence is not None
    _assert_untouched(client, name)


@pytest.mark.parametrize("chunks", [[4, 0, 4], [0, 8], [9, -1], [4, 3], [4, 5]])
def test_chunks_that_do_not_cut_the_batch_are_refused_before_sending(
        client: Client, make_head, chunks: list) -> None:
    """An empty chunk would be refused by the server after the others were counted."""
    name = make_head(11, 8, init_std=0.1)
    hidden, targets = torch.randn(8, 8), torch.randint(0, 11, (8,))
    with pytest.raises(ValueError, match="must be sizes >= 1 adding up to the batch's 8 tokens"):
        client.step_chunked(name, hidden, targets, chunks=chunks, streams=1)
    _assert_untouched(client, name)


def test_flattened_targets_pair_with_shaped_hidden(client: Client, make_head) -> None:
    v, d = 11, 8
    name = make_head(v, d, init_std=0.1)
    head = RemoteLMHead(client, name, reduction="none", wire_dtype=torch.float32)
    hidden, targets = torch.randn(2, 3, d), torch.randint(0, v, (2, 3))
    shaped = head.evaluate(hidden, targets)
    assert shaped.shape == (2, 3)
    assert torch.equal(head.evaluate(hidden, targets.reshape(-1)), shaped.reshape(-1))
    assert torch.equal(head.evaluate(hidden.reshape(-1, d), targets), shaped)


def test_step_wrong_weights_version(client: Client, make_head) -> None:
    name = make_head(5, 4)
    _raises(C.FAILED_PRECONDITION, lambda: client.step(
        name, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), expected_weights_version=2))
    _assert_untouched(client, name)
    r = client.step(name, torch.randn(3, 4), torch.zeros(3, dtype=torch.long),
                    expected_weights_version=1)
    assert r.weights_version == 1


def test_failed_microbatch_does_not_end_the_stream(client: Client, make_head) -> None:
    v, d = 9, 4
    name = make_head(v, d, init_std=0.1)
    good = (torch.randn(3, d), torch.randint(0, v, (3,)))
    bad = (torch.randn(3, d), torch.tensor([0, v, 1]))
    out = list(client.step_stream(name, [good, bad, good], return_errors=True, reduction="sum"))
    assert isinstance(out[0], type(out[2])) and not isinstance(out[0], LossheadError)
    assert isinstance(out[1], LossheadError) and out[1].code == C.INVALID_ARGUMENT
    assert client.get_head(name).microbatches_since_pull == 2
    with pytest.raises(LossheadError) as e:
        list(client.step_stream(name, [good, bad, good]))
    assert e.value.code == C.INVALID_ARGUMENT


def test_malformed_step_stream_ends_the_call(client: Client, make_head) -> None:
    name = make_head(4, 4)
    header = pb.StepHeader(head=name, client_id="raw", sequence=1, num_tokens=1,
                           hidden_dtype=pb.DTYPE_FP32, target_dtype=pb.DTYPE_INT64)
    cases = {
        "data outside a micro-batch": [pb.StepRequest(hidden=b"\0" * 16)],
        "header inside a micro-batch": [pb.StepRequest(header=header),
                                        pb.StepRequest(header=header)],
        "stream ends inside a micro-batch": [pb.StepRequest(header=header, hidden=b"\0" * 16)],
    }
    for what, requests in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(client._stub.Step(iter(requests)))
        assert e.value.code() == C.INVALID_ARGUMENT, what
    _assert_untouched(client, name)


def test_pull_and_push_invalid(client: Client, make_head) -> None:
    name = make_head(6, 4)
    _raises(C.INVALID_ARGUMENT, lambda: client.pull_gradient(name, dtype=torch.int32))
    _raises(C.INVALID_ARGUMENT, lambda: client.upload_weights(name, torch.zeros(6, 5)))
    _raises(C.INVALID_ARGUMENT, lambda: client.upload_weights(name, torch.zeros(5, 4)))
    _raises(C.INVALID_ARGUMENT, lambda: client.upload_weights(
        name, torch.zeros(6, 4, dtype=torch.int64), dtype=torch.int64))
    nan = torch.zeros(6, 4)
    nan[0, 0] = float("nan")
    _raises(C.INVALID_ARGUMENT, lambda: client.upload_weights(name, nan))
    _raises(C.FAILED_PRECONDITION,
            lambda: client.upload_weights(name, torch.ones(6, 4), expected_weights_version=7))
    _raises(C.INVALID_ARGUMENT, lambda: client.download_weights(name, dtype=torch.int32))
    down = client.download_weights(name)
    assert down.version == 1 and not down.weights.any()
