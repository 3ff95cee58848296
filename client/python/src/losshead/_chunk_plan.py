"""How a batch is cut into micro-batches for its Step streams.

A stream works on its micro-batches as a pipeline: while the server computes one, the next is
uploaded and the previous one's dH comes back. Two things decide how long a batch takes beyond
the computation itself: every stream needs micro-batches in flight (`depth` of them) so that its
upload, computation and download overlap, and the pipeline must fill and drain: nothing is
computed before the first micro-batch has arrived, and nothing is returned before the last one's
dH has been sent. Small first and last micro-batches (`edge_tokens`) make both short; the ones
between are as large as `chunk_tokens` allows, because each micro-batch also pays a fixed cost
on the server (one pass over the fp32 dW accumulator).

The loss, dH and dW do not depend on the cut: each micro-batch is summed on the server and the
sums are added up.
"""

from __future__ import annotations

from typing import List


def plan_chunks(n: int, *, streams: int, chunk_tokens: int, min_chunk_tokens: int,
                depth: int, edge_tokens: int = 0) -> List[int]:
    """Micro-batch sizes, in order, for a batch of `n` tokens over `streams` streams.

    Each is at most `chunk_tokens`; there are `depth` per stream where that keeps them at
    `min_chunk_tokens` or more; with `edge_tokens`, the first and last are that small when the
    batch is large enough for the others to stay at `min_chunk_tokens`.
    """
    if n <= 0:
        return [max(n, 0)]
    chunk = max(1, chunk_tokens)
    floor = max(1, min(min_chunk_tokens, chunk))
    fewest = -(-n // chunk)  # micro-batches needed to stay within chunk_tokens
    wanted = max(fewest, max(1, streams) * max(1, depth))
    # As many as wanted while each keeps `floor` tokens, never fewer than the chunk size needs.
    count = max(1, min(wanted, n // floor), fewest)
    edge = edge_tokens if 0 < edge_tokens < floor else 0
    if edge and count >= 3 and n - 2 * edge >= (count - 2) * floor:
        middle = n - 2 * edge
        inner = max(count - 2, -(-middle // chunk))
        return [edge] + _even(middle, inner) + [edge]
    return _even(n, count)


def _even(n: int, count: int) -> List[int]:
    """`n` split into `count` sizes that differ by at most one, larger first."""
    base, extra = divmod(n, count)
    return [base + (1 if i < extra else 0) for i in range(count)]
