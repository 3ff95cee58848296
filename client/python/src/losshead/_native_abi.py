"""The C ABI (client/capi/capi.h) as ctypes sees it: its structs, its functions' signatures, and
the loading of liblosshead_capi.so (once per process, with the reason when it is not used).

``$LOSSHEAD_CAPI_LIB``, else the library beside this package (setup.py copies it in);
``LOSSHEAD_NATIVE=0`` turns the native path off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

# The ABI version this package is written for: any library of it or later serves it (capi.h: a
# version only adds).
_ABI_VERSION = 4
_LIBRARY = "liblosshead_capi.so"
_c = ctypes
_p = ctypes.c_void_p


class _Status(_c.Structure):
    _fields_ = [("code", _c.c_int), ("retry_after_ms", _c.c_uint32), ("microbatch", _c.c_int),
                ("message", _c.c_char * 1024)]


class _IntArg(_c.Structure):
    _fields_ = [("key", _c.c_char_p), ("value", _c.c_int)]


class _MetadataPair(_c.Structure):
    _fields_ = [("key", _c.c_char_p), ("value", _c.c_char_p)]


class _Options(_c.Structure):
    _fields_ = [("max_message_bytes", _c.c_uint64), ("max_receive_message_bytes", _c.c_uint64),
                ("deadline_s", _c.c_double), ("dedicated_connection", _c.c_int),
                ("tls", _c.c_int), ("tls_root_pem", _c.c_char_p), ("tls_cert_pem", _c.c_char_p),
                ("tls_key_pem", _c.c_char_p), ("tls_server_name", _c.c_char_p),
                ("bearer_token", _c.c_char_p), ("retry_max_attempts", _c.c_int),
                ("retry_initial_backoff_s", _c.c_double), ("retry_max_backoff_s", _c.c_double),
                ("retry_multiplier", _c.c_double), ("retry_jitter", _c.c_double),
                ("channel_args", _c.POINTER(_IntArg)), ("num_channel_args", _c.c_size_t),
                ("metadata", _c.POINTER(_MetadataPair)), ("num_metadata", _c.c_size_t)]


class _CMicrobatch(_c.Structure):
    _fields_ = [("head", _c.c_char_p), ("client_id", _c.c_char_p), ("sequence", _c.c_uint64),
                ("num_tokens", _c.c_int64), ("hidden_dtype", _c.c_int), ("hidden", _p),
                ("hidden_bytes", _c.c_size_t), ("target_dtype", _c.c_int), ("targets", _p),
                ("targets_bytes", _c.c_size_t), ("options", _c.c_char_p),
                ("options_bytes", _c.c_size_t), ("loss_options", _c.c_char_p),
                ("loss_options_bytes", _c.c_size_t), ("grad_hidden_out", _p),
                ("grad_hidden_capacity", _c.c_size_t),
                ("per_token_loss_out", _c.POINTER(_c.c_float)),
                ("per_token_loss_capacity", _c.c_size_t),
                ("per_token_logprob_out", _p), ("per_token_entropy_out", _p),
                ("per_token_lse_out", _p), ("per_token_argmax_out", _p),
                ("token_output_capacity", _c.c_size_t), ("top_k_ids_out", _p),
                ("top_k_logprobs_out", _p), ("top_k_capacity", _c.c_size_t)]


class _CStepResult(_c.Structure):
    _fields_ = [("status", _Status), ("loss", _c.c_double), ("loss_sum", _c.c_double),
                ("token_count", _c.c_int64), ("weights_version", _c.c_uint64),
                ("replayed", _c.c_int), ("forward_only", _c.c_int),
                ("grad_hidden_dtype", _c.c_int), ("grad_hidden_bytes", _c.c_uint64),
                ("per_token_loss_count", _c.c_uint64),
                ("per_token_logprob_count", _c.c_uint64),
                ("per_token_entropy_count", _c.c_uint64),
                ("per_token_lse_count", _c.c_uint64), ("per_token_argmax_count", _c.c_uint64),
                ("has_correct_count", _c.c_int), ("correct_count", _c.c_int64),
                ("top_k_ids_count", _c.c_uint64), ("top_k_logprobs_count", _c.c_uint64)]


class _CInputs(_c.Structure):
    """lh_microbatch_inputs: the step kind and the per-token inputs (pointer, count each)."""
    _fields_ = [("kind", _c.c_int), ("token_weights", _p), ("token_weights_count", _c.c_size_t),
                ("old_logprob", _p), ("old_logprob_count", _c.c_size_t),
                ("advantages", _p), ("advantages_count", _c.c_size_t),
                ("ref_logprob", _p), ("ref_logprob_count", _c.c_size_t)]


class _EmbeddingRowsInfo(_c.Structure):
    _fields_ = [("num_rows", _c.c_int64), ("hidden_size", _c.c_int64), ("dtype", _c.c_int),
                ("weights_version", _c.c_uint64)]


class _GradientSummary(_c.Structure):
    _fields_ = [("vocab_size", _c.c_int64), ("hidden_size", _c.c_int64), ("dtype", _c.c_int),
                ("token_count", _c.c_uint64), ("microbatch_count", _c.c_uint64),
                ("min_weights_version", _c.c_uint64), ("max_weights_version", _c.c_uint64),
                ("total_bytes", _c.c_uint64), ("was_reset", _c.c_int)]


class _WeightsInfo(_c.Structure):
    _fields_ = [("vocab_size", _c.c_int64), ("hidden_size", _c.c_int64), ("dtype", _c.c_int),
                ("weights_version", _c.c_uint64)]


_S = _c.POINTER(_Status)
_SIGNATURES = {
    "lh_capi_version": (_c.c_int, []),
    "lh_client_connect": (_c.c_int, [_c.c_char_p, _c.POINTER(_Options), _c.POINTER(_p), _S]),
    "lh_client_free": (None, [_p]),
    "lh_client_set_token": (None, [_p, _c.c_char_p]),
    "lh_client_retries": (_c.c_uint64, [_p]),
    "lh_step_many_with_inputs": (_c.c_int, [_p, _c.POINTER(_CMicrobatch), _c.POINTER(_CInputs),
                                            _c.c_size_t, _c.c_size_t, _c.POINTER(_CStepResult),
                                            _S]),
    "lh_embedding_rows": (_c.c_int, [_p, _c.c_char_p, _c.POINTER(_c.c_int64), _c.c_size_t,
                                     _c.c_int, _c.c_int, _c.c_uint64, _p, _c.c_size_t,
                                     _c.POINTER(_EmbeddingRowsInfo), _S]),
    "lh_push_weights": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _p, _c.c_size_t, _c.c_int,
                                   _c.c_int, _c.c_uint64, _c.POINTER(_c.c_uint64), _S]),
    "lh_pull_gradient": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _c.c_int, _p, _c.c_size_t,
                                    _c.POINTER(_GradientSummary), _S]),
    "lh_download_weights": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _p, _c.c_size_t,
                                       _c.POINTER(_WeightsInfo), _S]),
}

# Version 5's transfers of a head with an output bias: bound when the library has them (a
# version 4 library still serves everything else; such heads then take the grpcio path).
_BIAS_VERSION = 5
_BIAS_SIGNATURES = {
    "lh_push_weights_bias": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _p, _c.c_size_t, _p,
                                        _c.c_size_t, _c.c_int, _c.c_int, _c.c_uint64,
                                        _c.POINTER(_c.c_uint64), _S]),
    "lh_pull_gradient_bias": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _c.c_int, _p, _c.c_size_t,
                                         _p, _c.c_size_t, _c.POINTER(_GradientSummary),
                                         _c.POINTER(_c.c_uint64), _S]),
    "lh_download_weights_bias": (_c.c_int, [_p, _c.c_char_p, _c.c_int, _p, _c.c_size_t, _p,
                                            _c.c_size_t, _c.POINTER(_WeightsInfo),
                                            _c.POINTER(_c.c_uint64), _S]),
}

# Version 6's same-node device path (losshead._device_path): bound when the library has it.
_DEVICE_VERSION = 6


class _SameNodeDevice(_c.Structure):
    _fields_ = [("index", _c.c_int), ("pci_bus_id", _c.c_char * 32)]


class _DeviceTensors(_c.Structure):
    """lh_device_tensors: where a micro-batch's tensors lie in a device region."""
    _fields_ = [("region", _p), ("hidden_offset", _c.c_uint64), ("hidden_bytes", _c.c_uint64),
                ("targets_offset", _c.c_uint64), ("targets_bytes", _c.c_uint64),
                ("grad_hidden_offset", _c.c_uint64), ("grad_hidden_bytes", _c.c_uint64)]


_DEVICE_SIGNATURES = {
    "lh_same_node_devices": (_c.c_int, [_p, _c.POINTER(_SameNodeDevice), _c.c_size_t,
                                        _c.POINTER(_c.c_size_t), _S]),
    "lh_device_region_register": (_c.c_int, [_p, _p, _c.c_size_t, _c.c_uint64, _c.c_uint64,
                                             _c.c_char_p, _c.POINTER(_p), _S]),
    "lh_device_region_free": (None, [_p]),
    "lh_step_many_device": (_c.c_int, [_p, _c.POINTER(_CMicrobatch), _c.POINTER(_CInputs),
                                       _c.POINTER(_DeviceTensors), _c.c_size_t, _c.c_size_t,
                                       _c.POINTER(_CStepResult), _c.POINTER(_c.c_int), _S]),
}

_lock = threading.Lock()
_loaded: Optional[Tuple[Optional[ctypes.CDLL], str]] = None


def _candidates() -> List[Path]:
    given = os.environ.get("LOSSHEAD_CAPI_LIB")
    return [Path(given)] if given else [Path(__file__).resolve().parent / _LIBRARY]


class NativeLibraryWarning(RuntimeWarning):
    """The native library was not found or failed to load: the slower grpcio path is used."""


def _load() -> Tuple[Optional[ctypes.CDLL], str]:
    """(library, where it came from) or (None, why not); loaded once per process. Warns once
    (NativeLibraryWarning) with the reason and the cost when it is neither loaded nor turned
    off."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if os.environ.get("LOSSHEAD_NATIVE", "1") == "0":
            _loaded = (None, "LOSSHEAD_NATIVE=0")
            return _loaded
        why = f"{_LIBRARY} not found"
        for path in _candidates():
            if not path.is_file():
                why = f"{path} does not exist"
                continue
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                why = f"cannot load {path}: {e}"
                continue
            try:
                for name, (restype, argtypes) in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
            except AttributeError as e:
                why = f"{path} lacks a function this package calls: {e}"
                continue
            if lib.lh_capi_version() < _ABI_VERSION:
                why = (f"{path} speaks ABI {lib.lh_capi_version()}, this package needs "
                       f"{_ABI_VERSION} or later")
                continue
            if lib.lh_capi_version() >= _BIAS_VERSION:
                for name, (restype, argtypes) in _BIAS_SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
            if lib.lh_capi_version() >= _DEVICE_VERSION:
                for name, (restype, argtypes) in _DEVICE_SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
            _loaded = (lib, str(path))
            return _loaded
        _loaded = (None, why)
    # Outside the lock: a warnings filter that raises must not leave it held.
    warnings.warn(
        f"losshead: the native data path is off ({why}); steps, pulls and pushes go through "
        "grpcio from Python instead, about 3 times slower per step (BENCHMARKS.md: 62,700 "
        "against 186,000 tokens/s for a 128256 x 4096 head). Install the package with "
        f"{_LIBRARY} (LOSSHEAD_CAPI_LIB when building it), or set LOSSHEAD_NATIVE=0 to choose "
        "the grpcio path without this warning", NativeLibraryWarning, stacklevel=3)
    return _loaded


def native_available() -> bool:
    """Whether the native library is loaded (then clients use it unless told otherwise)."""
    return _load()[0] is not None


def native_library() -> str:
    """The loaded library's path, or why none is loaded."""
    return _load()[1]
