"""The native data path: the C++ client (liblosshead_capi.so, client/capi/) through ctypes.

Tensors cross as pointers to their memory: hidden states and targets are read in place, dH and
per-token losses are written by the C++ side straight into tensors allocated here, and pulls and
downloads land in the result tensor. ctypes releases the GIL for the whole foreign call, so
framing, (de)serialisation and I/O run outside it and one Python thread per Step stream drives
the streams in parallel. Retries and idempotency are the C++ client's (the same policy as
`losshead.retry`).

Every micro-batch goes this way: loss micro-batches with their per-token inputs (token weights,
old and reference log-probs, advantages) and EMBEDDING_GRAD ones alike (ABI version 4), and so
do embedding rows.

The library is found at ``$LOSSHEAD_CAPI_LIB``, else beside this module (setup.py copies it in);
``LOSSHEAD_NATIVE=0`` turns the native path off. Without it the client speaks gRPC from Python.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import torch

from losshead import _wire
from losshead._channel import TlsFiles
from losshead._device_layout import copy_out, lay_out
from losshead._device_path import DevicePath, Region
from losshead._microbatch import Microbatch, Outcome, grad_dtype
from losshead._native_abi import (_BIAS_VERSION, NativeLibraryWarning, _CInputs, _CMicrobatch,
                                  _CStepResult, _DeviceTensors, _EmbeddingRowsInfo,
                                  _GradientSummary, _IntArg, _load, _MetadataPair, _Options,
                                  _Status, _WeightsInfo, native_available, native_library)
from losshead._plan import StepPlan
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead._types import StepResult, TokenOutputs, asks_outputs, missing_outputs
from losshead.errors import LossheadError, status_code
from losshead.retry import RetryPolicy

_c = ctypes
_p = ctypes.c_void_p


def _error(status: _Status, client_id: Optional[str] = None,
           sequence: Optional[int] = None) -> LossheadError:
    """A micro-batch's own error names it (as the gRPC path's); a call's does not."""
    mine = bool(status.microbatch)
    return LossheadError(status_code(status.code), status.message.decode(errors="replace"),
                         client_id=client_id if mine else None,
                         sequence=sequence if mine else None,
                         retry_after_ms=status.retry_after_ms)


def _ptr(t: torch.Tensor) -> Optional[int]:
    return t.data_ptr() if t.numel() else None


_nbytes = _wire.nbytes


class NativeClient:
    """One C++ Client (one gRPC channel, or a dedicated connection) behind the C ABI."""

    def __init__(self, target: str, *, retry: RetryPolicy, timeout: Optional[float],
                 max_message_bytes: int, tls: Optional[TlsFiles],
                 tls_server_name: Optional[str], token: Optional[str],
                 metadata: Sequence[Tuple[str, str]], channel_args: Sequence[Tuple[str, Any]],
                 dedicated: bool) -> None:
        lib = _load()[0]
        if lib is None:
            raise LossheadError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no native library: {native_library()}")
        self._lib = lib
        ints = [(k.encode(), int(v)) for k, v in channel_args
                if isinstance(v, int) and not k.startswith("grpc.max_")]
        args = (_IntArg * max(1, len(ints)))(*[_IntArg(k, v) for k, v in ints])
        md = (_MetadataPair * max(1, len(metadata)))(
            *[_MetadataPair(k.encode(), v.encode()) for k, v in metadata])
        opts = _Options(
            max_message_bytes=max_message_bytes, max_receive_message_bytes=64 << 20,
            deadline_s=float(timeout) if timeout is not None else 0.0,
            dedicated_connection=int(dedicated), tls=int(tls is not None),
            tls_root_pem=tls.root_ca if tls else None, tls_cert_pem=tls.cert if tls else None,
            tls_key_pem=tls.key if tls else None,
            tls_server_name=tls_server_name.encode() if tls_server_name else None,
            bearer_token=token.encode() if token else None,
            retry_max_attempts=retry.attempts, retry_initial_backoff_s=retry.initial_backoff,
            retry_max_backoff_s=retry.max_backoff, retry_multiplier=retry.multiplier,
            retry_jitter=retry.jitter, channel_args=args, num_channel_args=len(ints),
            metadata=md, num_metadata=len(metadata))
        handle, status = _p(), _Status()
        if lib.lh_client_connect(target.encode(), _c.byref(opts), _c.byref(handle),
                                 _c.byref(status)):
            raise _error(status)
        self._handle: Optional[int] = handle.value
        self._closed_retries = 0
        self._device = DevicePath(lib, self._live)

    def close(self) -> None:
        if getattr(self, "_handle", None):  # not set when __init__ failed
            self._device.close()
            self._closed_retries = self.retries  # still readable once closed
            self._lib.lh_client_free(self._handle)
            self._handle = None

    def _live(self) -> int:
        if not self._handle:
            raise LossheadError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")
        return self._handle

    def __del__(self) -> None:
        self.close()

    def set_token(self, token: Optional[str]) -> None:
        if self._handle:
            self._lib.lh_client_set_token(self._handle, token.encode() if token else None)

    @property
    def retries(self) -> int:
        if not self._handle:
            return self._closed_retries
        return int(self._lib.lh_client_retries(self._handle))

    # -- steps ------------------------------------------------------------------------------
    def device_bus(self, device: torch.device) -> Optional[str]:
        """Whether a CUDA buffer on `device` can take the same-node device path (the bus id it
        registers with), else None."""
        return self._device.bus_for(device)

    def step_many(self, mbs: Sequence[Microbatch], plan: StepPlan,
                  before_send: Optional[Callable[[], None]] = None) -> List[Outcome]:
        """Client::StepMany over one stream at a time, `plan.lane_depth` micro-batches on the
        wire; outcomes in input order; `before_send()` once the device micro-batches are in their
        region, before anything is sent. The gRPC path's counterpart is
        `losshead._step_stream.step_many`."""
        region, places = lay_out(self._device, mbs)
        try:
            if before_send is not None:
                before_send()
            return self._step_many(mbs, plan, region, places)
        finally:
            if region is not None:
                self._device.give(region)

    def _step_many(self, mbs: Sequence[Microbatch], plan: StepPlan, region: Optional[Region],
                   places: Dict[int, Tuple[int, int, int, int]]) -> List[Outcome]:
        n = len(mbs)
        keep: List[Any] = []  # what the C structs point to, alive until the call returns
        outs: List[Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, torch.Tensor]]] = []
        cmbs = (_CMicrobatch * n)()
        cins = (_CInputs * n)()
        devs = (_DeviceTensors * n)()
        back: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (host landing, device dH)
        for i, mb in enumerate(mbs):
            h = mb.header
            dh = mb.grad_hidden_out
            if dh is None and not h.options.skip_grad_hidden:
                # dH of a device micro-batch stays on its device (made on the stream that
                # fills it).
                on = mb.device_hidden.device if i in places else None  # type: ignore[union-attr]
                with torch.cuda.stream(mb.device_stream):  # None (a host micro-batch): no-op
                    dh = torch.empty((h.num_tokens, mb.hidden_size), dtype=grad_dtype(h),
                                     device=on)
            # Always room for them: a replayed answer carries them if the first attempt asked.
            ptl = torch.empty(max(0, h.num_tokens), dtype=torch.float32)
            # Room for each token output asked (a replay answers the same ones: the server
            # refuses a repeat of the key that asks others).
            asked = set(h.options.token_outputs)
            tos = {name: torch.empty(max(0, h.num_tokens), dtype=dtype)
                   for name, (value, dtype) in _TOKEN_OUTPUTS.items() if value in asked}
            k = h.options.top_k
            if k:
                for name, dtype in _TOP_K.items():
                    tos[name] = torch.empty((max(0, h.num_tokens), k), dtype=dtype)
            outs.append((dh, ptl, tos))
            fields = (h.head.encode(), h.client_id.encode(), h.options.SerializeToString(),
                      h.loss_options.SerializeToString())
            keep.append(fields)
            c = cmbs[i]
            c.head, c.client_id, c.options, c.loss_options = fields
            c.options_bytes, c.loss_options_bytes = len(fields[2]), len(fields[3])
            c.sequence, c.num_tokens = h.sequence, h.num_tokens
            c.hidden_dtype, c.target_dtype = h.hidden_dtype, h.target_dtype
            if i in places:
                # In the device region: the C side sends only the reference.
                hidden_at, targets_at, grad_at, grad = places[i]
                d = devs[i]
                d.region = region.handle  # type: ignore[union-attr]
                d.hidden_offset, d.hidden_bytes = hidden_at, _nbytes(mb.hidden)
                d.targets_offset, d.targets_bytes = targets_at, _nbytes(mb.targets)
                d.grad_hidden_offset, d.grad_hidden_bytes = grad_at, grad
            else:
                c.hidden, c.hidden_bytes = _ptr(mb.hidden), _nbytes(mb.hidden)
                c.targets, c.targets_bytes = _ptr(mb.targets), _nbytes(mb.targets)
                if dh is not None and dh.is_cuda:
                    # A device micro-batch that went the host's way: dH lands on the host, then
                    # goes where it was asked for.
                    landing = torch.empty(dh.shape, dtype=dh.dtype, pin_memory=True)
                    back.append((landing, dh))
                    dh = landing
                    outs[-1] = (dh, ptl, tos)
                if dh is not None:
                    c.grad_hidden_out, c.grad_hidden_capacity = _ptr(dh), _nbytes(dh)
            if ptl.numel():
                c.per_token_loss_out = _c.cast(ptl.data_ptr(), _c.POINTER(_c.c_float))
                c.per_token_loss_capacity = ptl.numel()
            for name, t in tos.items():
                setattr(c, f"{name}_out" if name in _TOP_K else f"per_token_{name}_out", _ptr(t))
            c.token_output_capacity = max(0, h.num_tokens)
            c.top_k_capacity = max(0, h.num_tokens) * h.options.top_k
            # The kind and the token inputs, read in place as the hidden states are.
            cins[i].kind = h.kind
            for name, t in mb.token_inputs.items():
                setattr(cins[i], name, _ptr(t))
                setattr(cins[i], f"{name}_count", t.numel())
        results, status = (_CStepResult * n)(), _Status()
        paths = (_c.c_int * n)()
        # A version 6 library reports each micro-batch's path, device regions or not.
        reported = self._device.library_has_it
        if reported:
            failed = n and self._lib.lh_step_many_device(self._live(), cmbs, cins, devs, n,
                                                         plan.lane_depth(n), results, paths,
                                                         _c.byref(status))
        else:
            failed = n and self._lib.lh_step_many_with_inputs(self._live(), cmbs, cins, n,
                                                              plan.lane_depth(n), results,
                                                              _c.byref(status))
        if failed:
            raise _error(status)
        if places:
            assert region is not None
            copy_out(region, places, mbs, [dh for dh, _, _ in outs],
                     [r.grad_hidden_bytes if not r.status.code else 0 for r in results])
        outcomes = [_outcome(mb, r, dh, ptl, tos,
                             _PATHS.get(paths[i], "network") if reported else None)
                    for i, (mb, r, (dh, ptl, tos)) in enumerate(zip(mbs, results, outs))]
        for landing, dh in back:
            dh.copy_(landing)
            for o in outcomes:
                if isinstance(o, StepResult) and o.grad_hidden is landing:
                    o.grad_hidden = dh
        return outcomes

    def embedding_rows_into(self, head: str, ids: torch.Tensor, dtype: int,
                            expected_weights_version: Optional[int], out: torch.Tensor
                            ) -> Tuple[_EmbeddingRowsInfo, bool]:
        """Client::EmbeddingRows for `ids` (contiguous int64, one message's worth) into the
        bytes of `out`; the answer's shape and dtype. Rows that do not fit `out` raise
        FAILED_PRECONDITION, except where the returned info says how many bytes they need
        (the second value False): `out` was sized from a stale hidden size."""
        info, status = _EmbeddingRowsInfo(), _Status()
        if self._lib.lh_embedding_rows(
                self._live(), head.encode(), _c.cast(ids.data_ptr(), _c.POINTER(_c.c_int64)),
                ids.numel(), dtype, int(expected_weights_version is not None),
                int(expected_weights_version or 0), _ptr(out), _nbytes(out), _c.byref(info),
                _c.byref(status)):
            need = info.num_rows * info.hidden_size * (
                _wire.element_size(info.dtype) if info.dtype else 0)
            if status_code(status.code) == grpc.StatusCode.FAILED_PRECONDITION and (
                    need > _nbytes(out)):
                return info, False
            raise _error(status)
        return info, True

    # -- transfers --------------------------------------------------------------------------
    def push(self, head: str, data: torch.Tensor, dtype: int, add: bool,
             expected_weights_version: Optional[int]) -> int:
        version, status = _c.c_uint64(), _Status()
        if self._lib.lh_push_weights(
                self._live(), head.encode(), dtype, _ptr(data), _nbytes(data), int(add),
                int(expected_weights_version is not None), int(expected_weights_version or 0),
                _c.byref(version), _c.byref(status)):
            raise _error(status)
        return int(version.value)

    def pull_into(self, head: str, dtype: int, reset: bool, out: torch.Tensor
                  ) -> _GradientSummary:
        summary, status = _GradientSummary(), _Status()
        if self._lib.lh_pull_gradient(self._live(), head.encode(), dtype, int(reset), _ptr(out),
                                      _nbytes(out), _c.byref(summary), _c.byref(status)):
            raise _error(status)
        return summary

    def download_into(self, head: str, dtype: int, out: torch.Tensor) -> _WeightsInfo:
        info, status = _WeightsInfo(), _Status()
        if self._lib.lh_download_weights(self._live(), head.encode(), dtype, _ptr(out),
                                         _nbytes(out), _c.byref(info), _c.byref(status)):
            raise _error(status)
        return info

    # -- a head with an output bias: b in a tensor of its own (version 5) ---------------------
    @property
    def carries_bias(self) -> bool:
        """Whether the library has the transfers of a head with an output bias."""
        return self._lib.lh_capi_version() >= _BIAS_VERSION

    def push_bias(self, head: str, data: torch.Tensor, bias: torch.Tensor, dtype: int,
                  add: bool, expected_weights_version: Optional[int]) -> int:
        version, status = _c.c_uint64(), _Status()
        if self._lib.lh_push_weights_bias(
                self._live(), head.encode(), dtype, _ptr(data), _nbytes(data), _ptr(bias),
                _nbytes(bias), int(add), int(expected_weights_version is not None),
                int(expected_weights_version or 0), _c.byref(version), _c.byref(status)):
            raise _error(status)
        return int(version.value)

    def pull_bias_into(self, head: str, dtype: int, reset: bool, out: torch.Tensor,
                       bias_out: torch.Tensor) -> Tuple[_GradientSummary, int]:
        """dW into `out`, db into `bias_out`; the summary and the bytes of db (0: no bias)."""
        summary, bias_bytes, status = _GradientSummary(), _c.c_uint64(), _Status()
        if self._lib.lh_pull_gradient_bias(
                self._live(), head.encode(), dtype, int(reset), _ptr(out), _nbytes(out),
                _ptr(bias_out), _nbytes(bias_out), _c.byref(summary), _c.byref(bias_bytes),
                _c.byref(status)):
            raise _error(status)
        return summary, int(bias_bytes.value)

    def download_bias_into(self, head: str, dtype: int, out: torch.Tensor,
                           bias_out: torch.Tensor) -> Tuple[_WeightsInfo, int]:
        info, bias_bytes, status = _WeightsInfo(), _c.c_uint64(), _Status()
        if self._lib.lh_download_weights_bias(
                self._live(), head.encode(), dtype, _ptr(out), _nbytes(out), _ptr(bias_out),
                _nbytes(bias_out), _c.byref(info), _c.byref(bias_bytes), _c.byref(status)):
            raise _error(status)
        return info, int(bias_bytes.value)


# The token outputs by their C field names: proto value and tensor dtype.
_TOKEN_OUTPUTS = {
    "logprob": (pb.TOKEN_OUTPUT_LOGPROB, torch.float32),
    "entropy": (pb.TOKEN_OUTPUT_ENTROPY, torch.float32),
    "lse": (pb.TOKEN_OUTPUT_LSE, torch.float32),
    "argmax": (pb.TOKEN_OUTPUT_ARGMAX, torch.int32),
}
# The top-k's buffers by their C field names (N x top_k each).
_TOP_K = {"top_k_ids": torch.int32, "top_k_logprobs": torch.float32}


# lh_step_many_device's paths (LH_PATH_*).
_PATHS = {0: "network", 1: "shared_memory", 2: "device"}


def _outcome(mb: Microbatch, r: _CStepResult, dh: Optional[torch.Tensor],
             ptl: Optional[torch.Tensor], tos: Dict[str, torch.Tensor],
             path: Optional[str] = None) -> Outcome:
    client_id, sequence = mb.key
    if r.status.code:
        return _error(r.status, client_id, sequence)
    if mb.header.options.forward_only and not r.forward_only:
        # A server that predates forward_only ignores it: this micro-batch was added to dW.
        return LossheadError(grpc.StatusCode.UNIMPLEMENTED,
                             f"micro-batch {sequence}: the server does not support "
                             "forward_only and counted it in dW (upgrade the server)",
                             client_id=client_id, sequence=sequence)
    grad_hidden = None
    if r.grad_hidden_bytes:
        if dh is None or r.grad_hidden_bytes != _nbytes(dh) or (
                _wire.to_torch_dtype(r.grad_hidden_dtype) != dh.dtype):
            return LossheadError(grpc.StatusCode.INTERNAL,
                                 f"micro-batch {sequence}: dH of {r.grad_hidden_bytes} bytes "
                                 f"of wire dtype {r.grad_hidden_dtype}, expected "
                                 f"{tuple(dh.shape) if dh is not None else 'none'} of "
                                 f"{dh.dtype if dh is not None else '-'}",
                                 client_id=client_id, sequence=sequence)
        grad_hidden = dh
    per_token_loss = None
    if ptl is not None and r.per_token_loss_count:
        per_token_loss = ptl[:r.per_token_loss_count]
    outputs = None
    opts = mb.header.options
    if asks_outputs(opts):
        got = {name: t[:getattr(r, f"per_token_{name}_count")]
               for name, t in tos.items() if name not in _TOP_K}
        top = {name: tos[name] for name in _TOP_K
               if name in tos and getattr(r, f"{name}_count") == tos[name].numel()}
        outputs = TokenOutputs(
            logprob=got.get("logprob"), entropy=got.get("entropy"), lse=got.get("lse"),
            argmax=got.get("argmax"),
            correct_count=int(r.correct_count) if r.has_correct_count else None,
            top_k_ids=top.get("top_k_ids"), top_k_logprobs=top.get("top_k_logprobs"))
        # The C++ client refuses an answer without an asked output (UNIMPLEMENTED) already.
        missing = missing_outputs(opts, outputs, mb.header.num_tokens)
        if missing:
            return LossheadError(grpc.StatusCode.INTERNAL,
                                 f"micro-batch {sequence}: answer without {missing}",
                                 client_id=client_id, sequence=sequence)
    return StepResult(loss=r.loss, loss_sum=r.loss_sum, token_count=r.token_count,
                      weights_version=r.weights_version, replayed=bool(r.replayed),
                      client_id=client_id, sequence=sequence, grad_hidden=grad_hidden,
                      per_token_loss=per_token_loss, forward_only=bool(r.forward_only),
                      outputs=outputs, data_path=path)
