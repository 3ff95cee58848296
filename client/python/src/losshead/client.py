"""Client for the losshead v1 gRPC service (proto/losshead/v1/losshead.proto).

Tensors are torch tensors on the caller's side and raw little-endian bytes on the wire. Every
failure raises `LossheadError` with the grpc.StatusCode of the call or of the failed micro-batch.
The client is put together from one module per concern: `_channel` (credentials, channel
arguments), `_base` (identity, retries, unary calls), `_health`, `_steps` (the Step methods)
over the two Step paths, `_native` (the C++ data path) and `_step_stream` (grpcio), which carry
the same `_microbatch.Microbatch` under the same `_plan.StepPlan`, `_transfers` (weights and
gradients) and `_head_state` (the gradient window's summary and discard, named snapshots).
README.md's "Package layout" orders them in layers.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import torch

from losshead import _wire
from losshead._channel import MiB, PemLike, default_client_id, load_tls
from losshead._channel import channel_options as _channel_options
from losshead._embeddings import Embeddings, EmbeddingRows
from losshead._head_state import HeadState
from losshead._health import HealthProbe
from losshead._native import NativeClient, native_available
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._proto.losshead.v1 import losshead_pb2_grpc as pb_grpc
from losshead._step_stream import StepStream
from losshead._steps import Steps
from losshead._transfers import Transfers
from losshead._types import (ClientProgress, Gradient, GradientSummary, HeadCheckpoint,
                             LossOptions, ReductionLike, StepResult, TokenOutputs, Weights,
                             combine_results, to_matmul_precision, to_reduction)
from losshead._wire import DTypeLike
from losshead.errors import LossheadError
from losshead.retry import RetryPolicy

__all__ = ["Client", "ClientProgress", "Gradient", "GradientSummary", "HeadCheckpoint",
           "LossOptions", "ReductionLike", "StepResult", "StepStream", "TokenOutputs", "Weights",
           "combine_results", "to_reduction"]


class Client(Steps, Transfers, Embeddings, HeadState):
    """A connection to one losshead server.

    `client_id` (default: host, pid and a random suffix) and a per-client sequence counter form
    the idempotency key of each micro-batch; a retry resends the same key, so the server
    replays it instead of adding it to dW again. `piece_bytes` bounds the tensor bytes per
    message (below the server's 4 MiB default limit). `timeout` applies to each attempt of a
    unary call or weight/gradient transfer; Step streams have none. Each Step stream gets a TCP
    connection of its own, opened the first time a call runs that many streams and kept for the
    next (one HTTP/2 connection carries about 2 GB/s: four streams over one run a Llama-sized
    step 1.2-1.7x slower, BENCHMARKS.md). `connections=k` caps them at k, the streams beyond
    sharing them in turn; a caller's `channel` carries every stream.

    `retry` (a `RetryPolicy`; default 5 attempts, 50 ms doubling to 2 s, +-20 % jitter) governs
    every method; see `losshead.retry` for what is retried and why nothing is counted twice.
    `retries` counts the attempts that were retries since the client was made.

    Against a head held by several server processes (a group), `target` may be any of them: the
    first micro-batch refused because its client id's home is another process moves the Step
    connections to that home (named in the refusal) and is sent again there; the native path's
    C++ client does the same. Not with a caller's `channel` (the refusal is raised).

    Security (plaintext by default): `token` is sent on every call as
    `authorization: Bearer <token>`. TLS is on when `tls` or any of `tls_root_ca` (CA that
    signed the server's certificate; default the system's roots), `tls_cert` / `tls_key`
    (client certificate and key, for mTLS) is given, each a file path or the PEM bytes;
    `tls_server_name` is the name to verify in the server's certificate instead of the
    target's host. With `channel` the TLS options are ignored (the channel has its own).
    `channel_options` are extra gRPC channel arguments.

    Data path: with the native library (`native_available()`), steps, pulls, pushes and
    downloads go through the C++ client (`losshead._native`): tensors are read and written in
    place, outside the GIL, one thread per Step stream; control calls and health stay on
    grpcio. `native=None` (default) uses it when it is there and no `channel` is given,
    `native=True` demands it (FAILED_PRECONDITION without it), `native=False` speaks gRPC from
    Python only. A caller's `channel` (interceptors, custom transports) sees every call, so it
    always takes the gRPC path. Both paths give the same results, errors and retries.
    """

    def __init__(self, target: str, *, client_id: Optional[str] = None,
                 channel: Optional[grpc.Channel] = None, timeout: Optional[float] = 300.0,
                 piece_bytes: int = 4 * MiB - 64 * 1024, retry: Optional[RetryPolicy] = None,
                 metadata: Sequence[Tuple[str, str]] = (), connections: Optional[int] = None,
                 token: Optional[str] = None, tls: bool = False, tls_root_ca: PemLike = None,
                 tls_cert: PemLike = None, tls_key: PemLike = None,
                 tls_server_name: Optional[str] = None,
                 channel_options: Sequence[Tuple[str, Any]] = (),
                 native: Optional[bool] = None) -> None:
        super().__init__()
        if connections is not None and connections < 1:
            raise ValueError(f"losshead: connections must be >= 1 (None: one per Step stream), "
                             f"got {connections}")
        self._connections_lock = threading.Lock()
        self._closed = False
        self.target = target
        self.client_id = client_id or default_client_id()
        self.timeout = timeout
        self.piece_bytes = int(piece_bytes)
        self.retry = retry if retry is not None else RetryPolicy()
        self._base_metadata = tuple(metadata)
        self.set_token(token)
        if native and channel is not None:
            raise ValueError("losshead: a caller's channel takes the gRPC path; native=True "
                             "cannot be honoured")
        options = _channel_options(self.retry, tls_server_name, channel_options)
        tls_files = None if channel is not None else load_tls(tls, tls_root_ca, tls_cert,
                                                              tls_key)
        credentials = tls_files.credentials() if tls_files is not None else None

        def make_channel(extra: Sequence[Tuple[str, Any]] = (),
                         to: Optional[str] = None) -> grpc.Channel:
            if credentials is None:
                return grpc.insecure_channel(to or target, options=options + list(extra))
            return grpc.secure_channel(to or target, credentials, options=options + list(extra))

        self._channel = channel or make_channel()
        self._stub = pb_grpc.LossHeadStub(self._channel)
        self._health = HealthProbe(self._channel)
        use_native = native if native is not None else (channel is None and native_available())
        self._extra_channels: List[grpc.Channel] = []
        self._step_stubs = [self._stub]
        self._use_native = use_native
        self._max_connections = 1 if channel is not None else connections

        def open_connection(index: int) -> None:
            # Index 0 is the main channel (gRPC path) or a native client on the default
            # subchannel pool; a local subchannel pool keeps each later one on a connection of
            # its own.
            if use_native:
                self._natives.append(NativeClient(
                    target, retry=self.retry, timeout=timeout,
                    max_message_bytes=self.piece_bytes + 64 * 1024, tls=tls_files,
                    tls_server_name=tls_server_name, token=self._token,
                    metadata=self._base_metadata, channel_args=options, dedicated=index > 0))
            elif index > 0:
                extra = make_channel([("grpc.use_local_subchannel_pool", 1)], self._step_home)
                self._extra_channels.append(extra)
                self._step_stubs.append(pb_grpc.LossHeadStub(extra))

        def move_steps(address: str) -> None:
            # The gRPC path's Step connections, each replaced by one to `address`; the old ones
            # stay open (other streams may still be on them) until close().
            moved = []
            for index in range(len(self._step_stubs)):
                pool = [("grpc.use_local_subchannel_pool", 1)] if index > 0 else []
                channel_to_home = make_channel(pool, address)
                self._extra_channels.append(channel_to_home)
                moved.append(pb_grpc.LossHeadStub(channel_to_home))
            self._step_stubs = moved

        # Where the gRPC path's steps go once a redirect named this client id's home (None:
        # `target`). A caller's channel cannot be copied to another address: no redirect is
        # followed there.
        self._step_home: Optional[str] = None
        self._move_steps = move_steps if channel is None else None
        self._open_connection = open_connection
        self._open_step_connections(connections or 1)

    def _open_step_connections(self, streams: int) -> None:
        """Opens connections until `streams` Step streams have one each, or the cap
        (`connections`) is reached; the streams of a call do this before they start."""
        with self._connections_lock:
            wanted = streams if self._max_connections is None else min(
                streams, self._max_connections)
            if self._closed:
                return  # its calls are refused; nothing new is opened for them
            have = len(self._natives) if self._use_native else len(self._step_stubs)
            for index in range(have, wanted):
                self._open_connection(index)

    def _follow_home(self, address: Optional[str]) -> bool:
        """Whether the gRPC path's steps go to `address`, the home of this client id named by a
        server of a group holding the head together (docs/multi-process.md), from now on: the
        first redirect moves them there, once (the home does not send them on). The native path's
        C++ client follows redirects itself."""
        if address is None or self._move_steps is None:
            return False
        with self._connections_lock:
            if self._closed:
                return False
            if self._step_home is None:
                self._move_steps(address)
                self._step_home = address
            return self._step_home == address

    def set_token(self, token: Optional[str]) -> None:
        """Sends `token` (None or "": none) on calls that start from now on; streams already open
        keep theirs. After the server re-read its token file (SIGHUP), a trainer switches to its
        new token without reconnecting."""
        md = list(self._base_metadata)
        if token:
            # Per call rather than as call credentials: gRPC sends call credentials only over
            # TLS, and a token on a plaintext loopback or proxied connection is supported.
            md.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(md) or None
        with self._connections_lock:
            self._token = token  # for the connections opened from now on
            for n in self._natives:
                n.set_token(token)

    def close(self) -> None:
        self._lanes.close()
        with self._connections_lock:
            self._closed = True
        for n in self._natives:
            n.close()
        for c in self._extra_channels:
            c.close()
        self._channel.close()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Client":
        # A connection to a server is shared, not copied: a deep copy of a module that speaks to
        # a head (RemoteLMHead) speaks to the same head through the same client.
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            f"losshead: a Client (connections to {self.target}) cannot be pickled; build one "
            "in each process from its target (and credentials)")

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health and stats -------------------------------------------------------------------
    def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        self._check_open()
        try:
            return self._health.check(service, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None

    def wait_until_serving(self, timeout: float = 30.0) -> None:
        """Polls health until SERVING; raises LossheadError(DEADLINE_EXCEEDED) after `timeout`."""
        self._check_open()
        self._health.wait_until_serving(self.target, timeout, self._metadata)

    def stats(self) -> pb.Stats:
        return self._unary(self._stub.GetStats, pb.GetStatsRequest())

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self, head: str = "") -> List[HeadCheckpoint]:
        """Writes the checkpoint of `head` (every head when empty) now; safe to repeat.

        FAILED_PRECONDITION when the server runs without --checkpoint_dir, NOT_FOUND for an
        unknown head.
        """
        response = self._unary(self._stub.Checkpoint, pb.CheckpointRequest(head=head))
        return [HeadCheckpoint(head=h.head, weights_version=h.weights_version,
                               microbatches_since_pull=h.microbatches_since_pull, bytes=h.bytes,
                               write_seconds=h.write_seconds,
                               clients=[ClientProgress.from_proto(c) for c in h.clients])
                for h in response.heads]

    def client_progress(self, head: str, client_id: Optional[str] = None) -> ClientProgress:
        """Acknowledged (applied) and persisted (checkpointed) sequence of `client_id` (default:
        this client's) on `head`. After a server restart, resend exactly the micro-batches
        above `persisted_sequence` (see the proto for when that is exact)."""
        return ClientProgress.from_proto(self._unary(
            self._stub.GetClientProgress,
            pb.GetClientProgressRequest(head=head, client_id=client_id or self.client_id)))

    # -- heads ------------------------------------------------------------------------------
    def create_head(self, name: str, vocab_size: int, hidden_size: int, *,
                    weight_dtype: DTypeLike = torch.bfloat16, init_std: Optional[float] = None,
                    seed: int = 0, default_options: Optional[LossOptions] = None,
                    replicas: int = 1, shards: Optional[int] = None,
                    matmul_precision: Optional[str] = None, bias: bool = False) -> pb.HeadInfo:
        """Creates a head with W = 0, or W ~ N(0, init_std^2) seeded by `seed`.

        `bias`: the head has an output bias b (V values, fp32 on the server, zeros at creation),
        the logits being logit_scale (h . w) + b as an nn.Linear(D, V, bias=True) computes them.
        W and b then travel together: `push_weights(..., bias=b)`, `download_weights(...).bias`,
        `pull_gradient(...).grad_bias`; the server-side optimizer steps both.

        `replicas`: the server devices holding it (1: one device; k > 1: replicated over k, each
        micro-batch running whole on one of them, the gradient window reduced across them; 0:
        every device of the server). `shards` instead: sharded by vocabulary rows over that many
        devices (0: every device), each holding V / shards rows of W, dW and the optimizer, every
        micro-batch running on all of them. The answer's `devices` names them.

        `matmul_precision` ("highest", "high" or "medium", as torch.set_float32_matmul_precision;
        None: unset, which is "highest") is what an fp32 head's three GEMMs may round their
        inputs to on the server's GPU: "high" to TF32, "medium" to bf16, the products summed in
        fp32 either way; softmax, loss, dW and the optimizer stay fp32. It is a permission (the
        CPU backend computes everything as "highest"), fixed for the head's life and kept by its
        checkpoints; HeadInfo's `spec.matmul_precision` reports it (MATMUL_PRECISION_HIGHEST
        when unset). bf16 and fp16 heads take "highest" only: INVALID_ARGUMENT for the others.
        Any other value raises ValueError before anything is sent."""
        precision = None if matmul_precision is None else to_matmul_precision(matmul_precision)
        if replicas < 0:
            raise ValueError(f"losshead: replicas must be >= 0, got {replicas}")
        if shards is not None and (shards < 0 or replicas != 1):
            raise ValueError(f"losshead: shards must be >= 0 and not given with replicas, got "
                             f"shards={shards}, replicas={replicas}")
        spec = pb.HeadSpec(name=name, vocab_size=int(vocab_size), hidden_size=int(hidden_size),
                           weight_dtype=_wire.to_wire_dtype(weight_dtype))
        if shards is not None:
            spec.placement.kind = pb.PLACEMENT_SHARDED
            spec.placement.devices = int(shards)
        elif replicas != 1:
            spec.placement.kind = pb.PLACEMENT_REPLICATED
            spec.placement.devices = int(replicas)
        if init_std is None:
            spec.init.zeros = True
        else:
            spec.init.normal.std = float(init_std)
            spec.init.normal.seed = int(seed)
        if default_options is not None:
            spec.default_options.CopyFrom(default_options.to_proto())
        if precision is not None:
            spec.matmul_precision = precision
        spec.bias = bool(bias)
        try:
            return self._unary(self._stub.CreateHead, pb.CreateHeadRequest(spec=spec))
        finally:
            self._head_facts.pop(name, None)  # what cut batches are checked against: stale now

    def get_head(self, name: str) -> pb.HeadInfo:
        return self._unary(self._stub.GetHead, pb.GetHeadRequest(name=name))

    def list_heads(self) -> List[pb.HeadInfo]:
        return list(self._unary(self._stub.ListHeads, pb.ListHeadsRequest()).heads)

    def delete_head(self, name: str) -> None:
        try:
            self._unary(self._stub.DeleteHead, pb.DeleteHeadRequest(name=name))
        finally:
            self._head_facts.pop(name, None)

    def set_loss_options(self, name: str, options: LossOptions) -> pb.HeadInfo:
        """Replaces the head's default loss options."""
        try:
            return self._unary(self._stub.SetLossOptions, pb.SetLossOptionsRequest(
                name=name, default_options=options.to_proto()))
        finally:
            self._head_facts.pop(name, None)

