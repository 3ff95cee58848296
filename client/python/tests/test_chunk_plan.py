"""How RemoteLMHead cuts a batch (losshead._chunk_plan), and step_chunked with given sizes."""

from __future__ import annotations

import random

import pytest
import torch

from _reference import assert_close, random_problem, reference
from losshead import Client
from losshead._chunk_plan import plan_chunks

FP32_REL = 2e-5


def test_every_stream_gets_depth_micro_batches() -> None:
    assert plan_chunks(8192, streams=1, chunk_tokens=2048, min_chunk_tokens=1024,
                       depth=4) == [2048] * 4
    assert plan_chunks(8192, streams=4, chunk_tokens=2048, min_chunk_tokens=1024,
                       depth=4) == [1024] * 8  # not 16 of 512: the floor holds
    assert plan_chunks(3000, streams=2, chunk_tokens=4096, min_chunk_tokens=500,
                       depth=2) == [750] * 4


def test_small_first_and_last_micro_batches() -> None:
    assert plan_chunks(8192, streams=1, chunk_tokens=2048, min_chunk_tokens=1024, depth=4,
                       edge_tokens=512) == [512, 1792, 1792, 1792, 1792, 512]
    # Too small a batch for edges that leave the others at the floor: an even cut.
    assert plan_chunks(2500, streams=1, chunk_tokens=2048, min_chunk_tokens=1024, depth=4,
                       edge_tokens=512) == [1250, 1250]
    # Edges no smaller than the floor are no edges.
    assert plan_chunks(4000, streams=2, chunk_tokens=4096, min_chunk_tokens=500, depth=2,
                       edge_tokens=500) == [1000] * 4


def test_random_plans_tile_the_batch() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        n = rng.randint(1, 50000)
        chunk = rng.randint(1, 9000)
        floor = rng.randint(1, 4096)
        edge = rng.choice([0, rng.randint(1, 2048)])
        sizes = plan_chunks(n, streams=rng.randint(1, 8), chunk_tokens=chunk,
                            min_chunk_tokens=floor, depth=rng.randint(1, 6), edge_tokens=edge)
        assert sum(sizes) == n and min(sizes) >= 1, (n, chunk, floor, edge, sizes)
        assert max(sizes) <= chunk, (n, chunk, floor, edge, sizes)


def test_step_chunked_with_given_sizes(client: Client, make_head) -> None:
    n, d, v = 700, 24, 60
    hidden, weight, targets = random_problem(n, d, v, seed=81, ignore_fraction=0.1)
    head = make_head(v, d, weights=weight)
    r = client.step_chunked(head, hidden, targets, chunks=[50, 300, 250, 100], streams=3,
                            hidden_dtype=torch.float32)
    assert client.get_head(head).microbatches_since_pull == 4
    ref = reference(hidden, weight, targets, reduction="sum")
    assert r.loss_sum == pytest.approx(float(ref.loss), rel=FP32_REL)
    assert_close(r.grad_hidden, ref.grad_hidden, FP32_REL, "dH")
    for bad in ([700, 1], [], [-1, 701]):
        with pytest.raises(ValueError, match="adding up"):
            client.step_chunked(head, hidden, targets, chunks=bad)
    assert client.get_head(head).microbatches_since_pull == 4  # refused ones counted nothing
