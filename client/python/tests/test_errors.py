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


# What the server would refuse in one micro-batch of a batch cut into several, after counting the
# others: the client checks the whole batch first (losshead._batch_check).
_CUT_BATCH_CASES = {
    # case: (value at hidden[33, 5] or None, targets[33] or None, wire, head dtype, reason)
    "nan": (float("nan"), None, torch.float32, torch.float32, "hidden contains NaN or Inf"),
    "inf": (float("-inf"), None, torch.float32, torch.float32, "hidden contains NaN or Inf"),
    "overflows_fp16_wire": (7e4, None, torch.float16, torch.float32,
                            "hidden contains NaN or Inf"),
    "overflows_fp16_head": (7e4, None, torch.float32, torch.float16,
                            "hidden overflows the head's dtype fp16 (largest magnitude 70000)"),
    "target_high": (None, 11, torch.float32, torch.float32,
                    "targets[33] = 11 is outside [0, 11) and is not ignore_index -100"),
    "target_negative": (None, -1, torch.float32, torch.float32,
                        "targets[33] = -1 is outside [0, 11) and is not ignore_index -100"),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("entry", ["step_chunked", "bridge"])
@pytest.mark.parametrize("case", sorted(_CUT_BATCH_CASES))
def test_a_cut_batch_the_server_would_refuse_in_part_is_refused_before_sending(
        client: Client, make_head, case: str, entry: str, device: str) -> None:
    v, d, n = 11, 8, 40
    value, target, wire, head_dtype, reason = _CUT_BATCH_CASES[case]
    name = make_head(v, d, dtype=head_dtype, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    if value is not None:
        hidden[33, 5] = value
    if target is not None:
        targets[33] = target
    hidden, targets = hidden.to(device), targets.to(device)
    head = RemoteLMHead(client, name, wire_dtype=wire, chunk_tokens=8, min_chunk_tokens=8,
                        edge_tokens=0, streams=2)
    call = {"step_chunked": lambda: client.step_chunked(name, hidden, targets, chunk_tokens=8,
                                                        hidden_dtype=wire),
            "bridge": lambda: head(hidden.requires_grad_(), targets)}[entry]
    e = _raises(C.INVALID_ARGUMENT, call)
    assert e.message == f"{reason}; nothing of the batch was sent" and e.sequence is None
    _assert_untouched(client, name)
    # One micro-batch is the server's to judge, with the same outcome: nothing counted.
    e = _raises(C.INVALID_ARGUMENT, lambda: client.step_chunked(
        name, hidden.detach(), targets, chunk_tokens=n, hidden_dtype=wire))
    assert e.sequence is not None
    _assert_untouched(client, name)


@pytest.mark.parametrize("value,refused", [(65519.0, False), (65520.0, True), (-65520.0, True)])
def test_a_cut_batch_is_refused_where_the_server_would_round_to_inf(
        client: Client, make_head, value: float, refused: bool) -> None:
    """fp16 rounds up to Inf from 65520 (its largest value, 65504, plus half a step): the
    client's limit is the server's, judged here on one micro-batch of the same values."""
    v, d, n = 11, 8, 40
    name = make_head(v, d, dtype=torch.float16, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    hidden[21, 2] = value
    whole = lambda: client.step_chunked(name, hidden, targets, chunk_tokens=n,  # noqa: E731
                                        hidden_dtype=torch.float32, forward_only=True)
    cut = lambda: client.step_chunked(name, hidden, targets, chunk_tokens=8,  # noqa: E731
                                      hidden_dtype=torch.float32, forward_only=True)
    if refused:
        assert _raises(C.INVALID_ARGUMENT, whole).sequence is not None  # the server's verdict
        assert _raises(C.INVALID_ARGUMENT, cut).sequence is None  # the client's, before sending
    else:
        assert whole().token_count == cut().token_count == n


def test_a_cut_batch_is_checked_against_the_ignore_index_the_server_uses(
        client: Client, make_head) -> None:
    v, d, n = 11, 8, 40
    name = make_head(v, d, init_std=0.1)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    targets[3] = -7

    def step(**kw: object) -> int:
        return client.step_chunked(name, hidden, targets, chunk_tokens=8, **kw).token_count

    assert step(loss_options=LossOptions(ignore_index=-7)) == n - 1  # the step's own
    _raises(C.INVALID_ARGUMENT, step)  # the built-in -100
    client.set_loss_options(name, LossOptions(ignore_index=-7))
    assert step() == n - 1  # the head's default, changed after the client had looked
    client.set_loss_options(name, LossOptions())
    e = _raises(C.INVALID_ARGUMENT, step)
    assert e.message == ("targets[3] = -7 is outside [0, 11) and is not ignore_index -100; "
                         "nothing of the batch was sent")
    info = client.get_head(name)
    assert (info.tokens_since_pull, info.microbatches_since_pull) == (2 * (n - 1), 10)


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
