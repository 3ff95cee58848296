"""The same-node path (docs/same-node.md) from Python: the native data path (the C++ client
through the C ABI) moves hidden states, targets and dH through shared memory when the server is
on this host, with the answers of the network path bit for bit; with --same_node=false it goes
over the network. Each result says which way it went (`data_path`). CUDA tensors take the device
path to a server computing on CUDA (skipped without a CUDA device), bit for bit too.
"""

from __future__ import annotations

import contextlib
import urllib.request
from typing import Iterator

import grpc
import pytest
import torch

from _reference import random_problem
from _servers import free_port
from losshead import Client, native_available, native_library
from losshead.errors import LossheadError


def _path_bytes(metrics_port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("losshead_step_data_bytes_total{"):
            labels, value = line[len("losshead_step_data_bytes_total{"):].split("} ")
            fields = dict(kv.split("=") for kv in labels.split(","))
            out[(fields["path"].strip('"'), fields["direction"].strip('"'))] = float(value)
    return out


def test_native_steps_through_shared_memory_bit_for_bit(servers) -> None:
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    n, d, v = 200, 48, 91
    hidden, weight, targets = random_problem(n, d, v, seed=5, ignore_fraction=0.2)
    answers = {}
    for same_node in (True, False):
        port = free_port()
        server = servers.start(f"--metrics_listen=127.0.0.1:{port}",
                               f"--same_node={'true' if same_node else 'false'}")
        with Client(server.address, native=True, client_id="sn") as c:
            assert c.native
            assert c.stats().HasField("same_node") == same_node
            c.create_head("h", v, d)
            c.upload_weights("h", weight)
            for wire in (torch.float32, torch.bfloat16):
                r = c.step("h", hidden, targets, hidden_dtype=wire, return_per_token_loss=True)
                assert r.data_path == ("shared_memory" if same_node else "network")
                answers[(same_node, wire)] = r
        moved = _path_bytes(port)
        tensors = moved[("shared_memory", "in")] + moved[("shared_memory", "out")]
        if same_node:
            assert tensors > 0 and moved[("network", "in")] == 0, moved
        else:
            assert tensors == 0, moved
    for wire in (torch.float32, torch.bfloat16):
        a, b = answers[(True, wire)], answers[(False, wire)]
        assert (a.loss, a.loss_sum, a.token_count) == (b.loss, b.loss_sum, b.token_count)
        assert torch.equal(a.grad_hidden, b.grad_hidden)
        assert torch.equal(a.per_token_loss, b.per_token_loss)


def _cuda_devices() -> list:
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_native_cuda_tensors_take_the_device_path_bit_for_bit(servers, monkeypatch) -> None:
    """A server computing on GPU 0; CUDA tensors on GPU 0 (and on GPU 1 when there is one: the
    device path when it is a peer of GPU 0, else the host path) against the grpcio client's
    network path with the same tensors on the host: answers, dH and dW bit for bit."""
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    monkeypatch.delenv("LOSSHEAD_DEVICE_PATH", raising=False)  # the default: on
    n, d, v = 300, 64, 97
    hidden, weight, targets = random_problem(n, d, v, seed=9, ignore_fraction=0.2)
    port = free_port()
    server = servers.start("--backend=cuda", "--devices=0", "--grad_stash_idle=inf",
                           f"--metrics_listen=127.0.0.1:{port}")
    with Client(server.address, native=True, client_id="dev") as c, \
            Client(server.address, native=False, client_id="net") as net:
        assert [x.index for x in c.stats().same_node.devices] == [0]
        for device in _cuda_devices():
            peer = device.index == 0 or torch.cuda.can_device_access_peer(0, device.index)
            want = "device" if peer else "shared_memory"
            for wire in (torch.float32, torch.bfloat16):
                a, b = f"dev-{device.index}-{wire}", f"net-{device.index}-{wire}"
                for name in (a, b):
                    net.create_head(name, v, d)
                    net.upload_weights(name, weight)
                h = hidden.to(device)
                r = c.step(a, h, targets.to(device), hidden_dtype=wire,
                           return_per_token_loss=True)
                s = net.step(b, hidden, targets, hidden_dtype=wire, return_per_token_loss=True)
                assert r.data_path == want
                assert (r.loss, r.loss_sum, r.token_count) == (s.loss, s.loss_sum, s.token_count)
                assert torch.equal(r.grad_hidden, s.grad_hidden)
                assert torch.equal(r.per_token_loss, s.per_token_loss)
                # Chunked, as RemoteLMHead steps: dH back on the tensor's device. One stream, so
                # that both heads add the micro-batches' dW in one order (bit for bit).
                chunks = [100, 150, 50]
                rc = c.step_chunked(a, h, targets.to(device), chunks=chunks, hidden_dtype=wire,
                                    grad_hidden_device=device, streams=1)
                sc = net.step_chunked(b, hidden, targets, chunks=chunks, hidden_dtype=wire,
                                      streams=1)
                assert rc.data_path == want
                assert rc.grad_hidden.device == device
                assert (rc.loss_sum, rc.token_count) == (sc.loss_sum, sc.token_count)
                assert torch.equal(rc.grad_hidden.cpu(), sc.grad_hidden)
                ga, gb = net.pull_gradient(a), net.pull_gradient(b)
                assert ga.summary.microbatch_count == gb.summary.microbatch_count == 4
                assert torch.equal(ga.grad, gb.grad)
    moved = _path_bytes(port)
    assert moved[("device", "in")] > 0 and moved[("device", "out")] > 0, moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fresh_clients_lanes_take_their_first_regions_at_once(servers, monkeypatch) -> None:
    """Each fresh client's four lanes make their first device regions at the same moment (the
    step's first call on every lane): torch's storage sharing, called from the lanes at once,
    crashed the process. Ten fresh clients in turn, each step against the network path's
    answers and dH bit for bit."""
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    monkeypatch.delenv("LOSSHEAD_DEVICE_PATH", raising=False)
    n, d, v = 512, 64, 97
    hidden, weight, targets = random_problem(n, d, v, seed=21, ignore_fraction=0.1)
    server = servers.start("--backend=cuda", "--devices=0")
    chunks = [64] * 8
    with Client(server.address, native=False, client_id="net") as net:
        for name in ("lanes", "net"):
            net.create_head(name, v, d)
            net.upload_weights(name, weight)
        s = net.step_chunked("net", hidden, targets, chunks=chunks, streams=1)
        for i in range(10):
            with Client(server.address, native=True, connections=4,
                        client_id=f"lanes-{i}") as c:
                r = c.step_chunked("lanes", hidden.to("cuda:0"), targets.to("cuda:0"),
                                   chunks=chunks, streams=4, grad_hidden_device="cuda:0")
            assert r.data_path == "device"
            assert (r.loss_sum, r.token_count) == (s.loss_sum, s.token_count)
            assert torch.equal(r.grad_hidden.cpu(), s.grad_hidden)


@contextlib.contextmanager
def _device_and_network(servers, monkeypatch, seed: int, *flags: str) -> Iterator[tuple]:
    """A 512-token problem (D 64, V 97), a server computing on GPU 0, a native client of four
    connections ("dev") and a grpcio one ("net"), each with a head of the same weights, named as
    the client: (dev, net, hidden, targets), the tensors on the host."""
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    monkeypatch.delenv("LOSSHEAD_DEVICE_PATH", raising=False)  # the default: on
    hidden, weight, targets = random_problem(512, 64, 97, seed=seed, ignore_fraction=0.1)
    server = servers.start("--backend=cuda", "--devices=0", *flags)
    with Client(server.address, native=True, connections=4, client_id="dev") as dev, \
            Client(server.address, native=False, client_id="net") as net:
        for name in ("dev", "net"):
            net.create_head(name, 97, 64)
            net.upload_weights(name, weight)
        yield dev, net, hidden, targets


_CHUNKS = [64] * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cut_device_batch_is_checked_on_every_stream_and_refused_whole(servers,
                                                                        monkeypatch) -> None:
    """The device path checks a cut batch on the streams' threads once their regions are
    filled (the first of them for all): a NaN in the last micro-batch, or a target outside the
    vocabulary, fails the call INVALID_ARGUMENT on four streams with nothing sent (the window
    stays empty); the regions then serve a good step, bit for bit against the network path."""
    with _device_and_network(servers, monkeypatch, 33) as (c, net, hidden, targets):
        nan = hidden.clone()
        nan[-3, 5] = float("nan")
        far = targets.clone()
        far[-1] = 97
        for h, t, why in ((nan, targets, "NaN"), (hidden, far, "outside [0, 97)")):
            with pytest.raises(LossheadError) as e:
                c.step_chunked("dev", h.to("cuda:0"), t.to("cuda:0"), chunks=_CHUNKS,
                               streams=4, grad_hidden_device="cuda:0")
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert why in e.value.message and "nothing of the batch was sent" in e.value.message
            assert c.get_head("dev").tokens_since_pull == 0
        r = c.step_chunked("dev", hidden.to("cuda:0"), targets.to("cuda:0"), chunks=_CHUNKS,
                           streams=4, grad_hidden_device="cuda:0")
        s = net.step_chunked("net", hidden, targets, chunks=_CHUNKS, streams=1)
        assert r.data_path == "device"
        assert (r.loss_sum, r.token_count) == (s.loss_sum, s.token_count)
        assert torch.equal(r.grad_hidden.cpu(), s.grad_hidden)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_device_path_follows_the_callers_stream(servers, monkeypatch) -> None:
    """Hidden states and targets made on a side stream and dH read there: the copies into and
    out of the regions go on the caller's stream from every lane's thread, and dH is not waited
    for on the host, so only that ordering makes it right. Five steps in a row (the regions
    reused, each waiting for the last one's copies out), against the network path bit for
    bit; the targets come from the host, then from the device (copied device to device)."""
    with _device_and_network(servers, monkeypatch, 35, "--grad_stash_idle=inf") as (
            c, net, hidden, targets):
        side = torch.cuda.Stream()
        for k in range(5):
            scale = 1.0 + k / 4
            s = net.step_chunked("net", hidden * scale, targets, chunks=_CHUNKS, streams=1)
            with torch.cuda.stream(side):
                on_device = hidden.to("cuda:0", non_blocking=False)
                torch.cuda._sleep(2_000_000)  # the side stream still busy as the step starts
                h = on_device * scale
                t = targets if k < 2 else (targets.to("cuda:0") + 1) - 1  # made on the stream
                r = c.step_chunked("dev", h, t, chunks=_CHUNKS, streams=4,
                                   grad_hidden_device="cuda:0")
                assert r.data_path == "device"
                got = r.grad_hidden * 1  # read on the side stream
            side.synchronize()
            assert (r.loss_sum, r.token_count) == (s.loss_sum, s.token_count)
            assert torch.equal(got.cpu(), s.grad_hidden)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_targets_on_the_device_are_checked_there(servers, monkeypatch) -> None:
    """A cut batch's targets on the hidden states' device stay there and are judged there
    against the head's facts as this client knows them: a target outside V is refused with the
    host check's message whether the facts were known yet or not; after another client
    recreated the head wider, the same target is judged again on the host against fresh facts
    and goes through; with the device regions refused, the targets reach the host path. Each
    good step bit for bit against the network path."""
    from losshead._device_path import DevicePath

    def same(r, s) -> None:
        assert (r.loss_sum, r.token_count) == (s.loss_sum, s.token_count)
        assert torch.equal(r.grad_hidden.cpu(), s.grad_hidden)

    with _device_and_network(servers, monkeypatch, 37) as (c, net, hidden, targets):
        far = targets.clone()
        far[200] = 100
        h, t, t_far = hidden.to("cuda:0"), targets.to("cuda:0"), far.to("cuda:0")
        for known in (False, True):
            counted = c.get_head("dev").tokens_since_pull
            with pytest.raises(LossheadError) as e:
                c.step_chunked("dev", h, t_far, chunks=_CHUNKS, streams=4)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "targets[200] = 100 is outside [0, 97)" in e.value.message, known
            assert c.get_head("dev").tokens_since_pull == counted
            r = c.step_chunked("dev", h, t, chunks=_CHUNKS, streams=4)
            assert r.data_path == "device"
            same(r, net.step_chunked("net", hidden, targets, chunks=_CHUNKS, streams=1))
        wider = torch.randn(120, 64, generator=torch.Generator().manual_seed(38)) * 0.1
        for name in ("dev", "net"):
            net.delete_head(name)
            net.create_head(name, 120, 64)
            net.upload_weights(name, wider)
        r = c.step_chunked("dev", h, t_far, chunks=_CHUNKS, streams=4)
        assert r.data_path == "device"
        same(r, net.step_chunked("net", hidden, far, chunks=_CHUNKS, streams=1))
        monkeypatch.setattr(DevicePath, "take", lambda self, device, nbytes: None)
        r = c.step_chunked("dev", h, t_far, chunks=_CHUNKS, streams=4)
        assert r.data_path == "shared_memory"
        same(r, net.step_chunked("net", hidden, far, chunks=_CHUNKS, streams=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_path_off_takes_the_host_path_bit_for_bit(servers, monkeypatch) -> None:
    """LOSSHEAD_DEVICE_PATH=0: a CUDA tensor on the server's own GPU takes the host path
    (shared memory), with the network path's answers and dH."""
    if not native_available():
        pytest.skip(f"no native library: {native_library()}")
    monkeypatch.setenv("LOSSHEAD_DEVICE_PATH", "0")
    n, d, v = 200, 64, 97
    hidden, weight, targets = random_problem(n, d, v, seed=13, ignore_fraction=0.1)
    server = servers.start("--backend=cuda", "--devices=0", "--grad_stash_idle=inf")
    with Client(server.address, native=True, client_id="off") as c, \
            Client(server.address, native=False, client_id="net") as net:
        for name in ("off", "net"):
            net.create_head(name, v, d)
            net.upload_weights(name, weight)
        r = c.step("off", hidden.to("cuda:0"), targets.to("cuda:0"))
        s = net.step("net", hidden, targets)
        assert r.data_path == "shared_memory"
        assert (r.loss_sum, r.token_count) == (s.loss_sum, s.token_count)
        assert torch.equal(r.grad_hidden, s.grad_hidden)


class _DeviceAbi:
    """A library that reports the device path's C ABI version and nothing else."""

    def lh_capi_version(self) -> int:
        from losshead._native_abi import _DEVICE_VERSION
        return _DEVICE_VERSION


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("yes", True)])
def test_device_path_is_on_unless_turned_off(monkeypatch, value, on) -> None:
    """The device path is the default; only LOSSHEAD_DEVICE_PATH=0 turns it off."""
    from losshead._device_path import DevicePath
    if value is None:
        monkeypatch.delenv("LOSSHEAD_DEVICE_PATH", raising=False)
    else:
        monkeypatch.setenv("LOSSHEAD_DEVICE_PATH", value)
    assert DevicePath(_DeviceAbi(), lambda: None).supported is on


def test_torch_ipc_handles_are_read_in_both_layouts() -> None:
    """torch's ``_share_cuda_()`` gives the 64-byte cudaIpcMemHandle_t alone (older torch), or
    after a version byte and a kind byte; only the kind of cudaMalloc memory is a runtime IPC
    handle (an expandable segment's is not: such memory takes the host path)."""
    from losshead._device_path import _ipc_handle
    raw = bytes(range(64))
    assert _ipc_handle(raw) == raw
    assert _ipc_handle(b"\x02c" + raw) == raw
    assert _ipc_handle(b"\x02e" + raw) is None
    assert _ipc_handle(raw[:63]) is None
    assert _ipc_handle(b"\x02c" + raw + b"\x00") is None
