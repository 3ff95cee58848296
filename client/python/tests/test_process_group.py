"""A head replicated across two server processes (a group: docs/multi-process.md) trained through
RemoteLMHead and RemoteHeadOptimizer from a client of the follower whose client id's home is the
leader: the client reaches the home by itself (no argument beyond the target), on the gRPC path
and the native one, and every loss, dH, W and b equals a one-process server's given the same
batches. The head has an output bias, summed across the processes beside W's gradient."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import pytest
import torch

from _reference import assert_close, random_problem
from _servers import ServerFactory, ServerProcess, free_port
from losshead import Client, RemoteHeadOptimizer, RemoteLMHead, native_available, native_library

HEAD = "grouped"
PROCESSES = 2


def home(client_id: str, processes: int) -> int:
    """The home rule from its definition: FNV-1a 64 of the id's bytes, mod the processes."""
    h = 0xcbf29ce484222325
    for byte in client_id.encode():
        h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h % processes


@pytest.fixture
def group(servers: ServerFactory) -> Iterator[Tuple[List[ServerProcess], ServerProcess]]:
    """Two processes of one group (started together: each waits for the other), and a
    one-process server to compare with."""
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(PROCESSES))
    processes = [servers.spawn("--grad_stash_bytes=0", f"--group_peers={peers}",
                               f"--group_rank={rank}", "--group_bootstrap_timeout=30s",
                               "--group_op_timeout=5s")
                 for rank in range(PROCESSES)]
    for process in processes:
        process.wait_serving(timeout=40.0)
    yield processes, servers.start("--grad_stash_bytes=0")


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_available(), reason=f"no native library: {native_library()}"))],
    ids=["grpc", "native"])
def test_remote_head_trains_through_a_follower_as_on_one_process(group, native: bool) -> None:
    processes, single = group
    d, v = 16, 29
    # Connected to the follower (process 1); its micro-batches' home is the leader.
    client_id = next(f"trainer-{i}" for i in range(100) if home(f"trainer-{i}", PROCESSES) == 0)
    with Client(processes[1].address, client_id=client_id, native=native) as member, \
            Client(single.address, client_id=client_id, native=native) as alone:
        clients = (member, alone)
        for c in clients:
            c.create_head(HEAD, v, d, weight_dtype=torch.float32, init_std=0.2, seed=9, bias=True)
        heads = [RemoteLMHead(c, HEAD, wire_dtype=torch.float32, chunk_tokens=16, streams=2)
                 for c in clients]
        mirrors = [RemoteHeadOptimizer(c, HEAD) for c in clients]
        optimizers = [torch.optim.AdamW([m.weight, m.bias], lr=1e-2, weight_decay=0.1)
                      for m in mirrors]
        for step in range(3):
            for k in range(2):
                hidden, _, targets = random_problem(24 + 8 * k, d, v, seed=10 * step + k,
                                                    ignore_fraction=0.2)
                losses, grads = [], []
                for head in heads:
                    h = hidden.clone().requires_grad_()
                    loss = head(h, targets)
                    loss.backward()
                    losses.append(loss.detach())
                    grads.append(h.grad)
                assert torch.equal(losses[0], losses[1]), f"step {step}: loss"
                assert_close(grads[0], grads[1], 1e-6, f"step {step}: dH")
            summaries = [m.step(o) for m, o in zip(mirrors, optimizers)]
            assert summaries[0].token_count == summaries[1].token_count > 0
            assert summaries[0].microbatch_count == summaries[1].microbatch_count
        got, want = member.download_weights(HEAD), alone.download_weights(HEAD)
        assert got.version == want.version
        assert_close(got.weights, want.weights, 1e-6, "W")
        assert got.bias is not None and want.bias is not None
        assert_close(got.bias, want.bias, 1e-6, "b")
        # The leader holds the same W and b, bit for bit.
        with Client(processes[0].address) as leader:
            there = leader.download_weights(HEAD)
            assert torch.equal(there.weights, got.weights) and torch.equal(there.bias, got.bias)
