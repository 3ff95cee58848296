"""The same-node path (docs/same-node.md) from Python: the native data path (the C++ client
through the C ABI) moves hidden states, targets and dH through shared memory when the server is
on this host, with the answers of the network path bit for bit; with --same_node=false it goes
over the network.
"""

from __future__ import annotations

import urllib.request

import pytest
import torch

from _reference import random_problem
from _servers import free_port
from losshead import Client, native_available, native_library


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
