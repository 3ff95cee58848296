"""The client's calls for a head tied to its model's input embedding (StepKind in the proto).

`embedding_rows` reads the rows of W for token ids (EmbeddingRows, split so that each request
stays under the message limit, every part read at one weights version); `embedding_grad` sends
the gradient of those rows back as an EMBEDDING_GRAD micro-batch on a Step stream, where it has
a loss micro-batch's exactly-once key, admission and retries, and lands in the same dW window.
Both take the client's data path: the C++ client (`losshead._native`) where it is in use, else
grpcio from Python; the answers are the same bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import grpc
import torch

from losshead import _step_stream, _wire
from losshead._base import ClientBase
from losshead._microbatch import Microbatch
from losshead._plan import StepPlan
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._transfers import _assemble
from losshead._types import StepResult
from losshead._wire import DTypeLike
from losshead.errors import LossheadError

_ONE = StepPlan(streams=1)


@dataclass
class EmbeddingRows:
    rows: torch.Tensor  # N x D on the CPU, in the order of the ids
    version: int        # the weights version every row was read at


def _ids(ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype not in (torch.int32, torch.int64) or ids.is_floating_point():
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"losshead: embedding ids must be int32 or int64, got {ids.dtype}")
    return ids.detach().reshape(-1).to("cpu", torch.int64).contiguous()


class Embeddings(ClientBase):
    """Client's embedding calls (see the module docstring)."""

    def embedding_rows(self, head: str, ids: torch.Tensor, *, dtype: Optional[DTypeLike] = None,
                       expected_weights_version: Optional[int] = None) -> EmbeddingRows:
        """Rows of W for `ids` (any shape, flattened; each in [0, V)) as an N x D CPU tensor in
        `dtype` (default the head's weight dtype). Requests larger than a message are split, and
        every part is read at the first part's weights version: when W changes between them,
        the whole read starts again (twice at most, then FAILED_PRECONDITION)."""
        self._check_open()
        flat = _ids(ids)
        if flat.numel() == 0:
            raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                                "losshead: embedding_rows needs at least one id")
        per_request = max(1, self.piece_bytes // 8)
        attempts = 3 if expected_weights_version is None else 1
        for attempt in range(attempts):
            version = expected_weights_version
            parts: List[torch.Tensor] = []
            try:
                for start in range(0, flat.numel(), per_request):
                    part = flat[start:start + per_request]
                    if self._natives:  # the C++ client retries by itself
                        rows, got = self._embedding_rows_native(head, part, dtype, version)
                    else:
                        rows, got = self._with_retry(
                            lambda part=part, version=version: self._embedding_rows_once(
                                head, part, dtype, version))
                    version = got
                    parts.append(rows)
            except LossheadError as e:
                if (e.code == grpc.StatusCode.FAILED_PRECONDITION and attempt + 1 < attempts
                        and len(parts) > 0):
                    continue  # W moved between the parts: read them all again
                raise
            assert version is not None
            return EmbeddingRows(rows=parts[0] if len(parts) == 1 else torch.cat(parts),
                                 version=int(version))
        raise AssertionError("unreachable")

    def _embedding_rows_once(self, head: str, ids: torch.Tensor, dtype: Optional[DTypeLike],
                             version: Optional[int]):
        request = pb.EmbeddingRowsRequest(
            head=head, id_dtype=pb.DTYPE_INT64, ids=ids.numpy().tobytes(),
            dtype=_wire.to_wire_dtype(dtype) if dtype is not None else 0)
        if version is not None:
            request.expected_weights_version = int(version)
        first, buf = _assemble("EmbeddingRows", lambda: self._stub.EmbeddingRows(
            request, timeout=self.timeout, metadata=self._metadata), lambda c: c)
        rows = _wire.decode(buf, first.dtype, (first.num_rows, first.hidden_size))
        return rows, first.weights_version

    def _embedding_rows_native(self, head: str, ids: torch.Tensor, dtype: Optional[DTypeLike],
                               version: Optional[int]) -> Tuple[torch.Tensor, int]:
        """One EmbeddingRows through the C++ client, into a tensor sized from the head's hidden
        size and weight dtype (read once per head; read again when the answer says the rows
        need more room: the head was created again, wider)."""
        for fresh in (False, True):
            shape = self._embedding_shapes.get(head)
            if shape is None or fresh:
                spec = self.get_head(head).spec
                shape = (int(spec.hidden_size), _wire.to_torch_dtype(spec.weight_dtype))
                self._embedding_shapes[head] = shape
            d, head_dtype = shape
            dt = _wire.to_torch_dtype(dtype) if dtype is not None else head_dtype
            out = torch.empty((ids.numel(), d), dtype=dt)
            # No dtype: the head's, which the server decides (as on the gRPC path).
            info, fitted = self._natives[0].embedding_rows_into(
                head, ids, _wire.to_wire_dtype(dtype) if dtype is not None else 0, version, out)
            if fitted:
                got = _wire.to_torch_dtype(info.dtype)
                if (info.num_rows, info.hidden_size, got) != (ids.numel(), d, dt):
                    # Narrower than the buffer (a head created again): its rows as they came.
                    if dtype is None:
                        self._embedding_shapes[head] = (int(info.hidden_size), got)
                    flat = out.reshape(-1).view(torch.uint8)
                    size = info.num_rows * info.hidden_size * torch.empty(
                        (), dtype=got).element_size()
                    out = flat[:size].view(got).reshape(info.num_rows, info.hidden_size).clone()
                return out, int(info.weights_version)
        raise LossheadError(grpc.StatusCode.INTERNAL,
                            f"losshead: EmbeddingRows of '{head}' did not fit twice")

    def embedding_microbatch(self, head: str, ids: torch.Tensor, grad: torch.Tensor, *,
                             grad_dtype: Optional[DTypeLike] = None,
                             sequence: Optional[int] = None,
                             expected_weights_version: Optional[int] = None) -> Microbatch:
        """Encodes an EMBEDDING_GRAD micro-batch: `grad` (..., D) for `ids` (...)."""
        flat = _ids(ids)
        d = grad.shape[-1]
        g2 = grad.detach().reshape(-1, d)
        if g2.shape[0] != flat.numel():
            raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"losshead: {g2.shape[0]} gradient rows for {flat.numel()} ids")
        wire = grad_dtype if grad_dtype is not None else (
            g2.dtype if g2.dtype in (torch.float32, torch.bfloat16, torch.float16)
            else torch.float32)
        opts = pb.StepOptions()
        if expected_weights_version is not None:
            opts.expected_weights_version = int(expected_weights_version)
        header = pb.StepHeader(
            head=head, kind=pb.STEP_KIND_EMBEDDING_GRAD, client_id=self.client_id,
            sequence=int(sequence) if sequence is not None else self.next_sequence(),
            num_tokens=flat.numel(), hidden_dtype=_wire.to_wire_dtype(wire),
            target_dtype=pb.DTYPE_INT64, options=opts)
        return Microbatch(header=header, hidden=_wire.host_tensor(g2, wire), targets=flat,
                          hidden_size=d)

    def embedding_grad(self, head: str, ids: torch.Tensor, grad: torch.Tensor, *,
                       grad_dtype: Optional[DTypeLike] = None, sequence: Optional[int] = None,
                       expected_weights_version: Optional[int] = None) -> StepResult:
        """Adds `grad` (..., D: the gradient of the rows `embedding_rows` gave for `ids`) into the
        head's dW window: dW[id] += row for every id, repeated ids summed. Exactly once under
        (client_id, sequence): a retry (automatic on a transient failure) replays. The result
        has no loss or dH; its `weights_version` is the one the rows landed on."""
        self._check_open()
        mb = self.embedding_microbatch(head, ids, grad, grad_dtype=grad_dtype, sequence=sequence,
                                       expected_weights_version=expected_weights_version)
        self._open_step_connections(1)
        if self._natives:
            (outcome,) = self._natives[0].step_many([mb], _ONE)
        else:
            (outcome,) = _step_stream.step_many(self, 0, [mb], _ONE)
        if isinstance(outcome, LossheadError):
            raise outcome
        return outcome
