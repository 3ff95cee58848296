"""Channel set-up: client ids, TLS credentials from PEM files or bytes, channel arguments."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import grpc

from losshead.errors import LossheadError
from losshead.retry import RetryPolicy

# PEM data for the TLS options: a file path, or the PEM bytes themselves.
PemLike = Union[str, bytes, "os.PathLike[str]", None]
MiB = 1 << 20


def default_client_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def read_pem(value: PemLike, what: str) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise LossheadError(grpc.StatusCode.NOT_FOUND,
                            f"cannot read {what} '{os.fspath(value)}': {e.strerror}") from None


@dataclass(frozen=True)
class TlsFiles:
    """The TLS options with their PEM data read (once, for both the gRPC and native paths)."""

    root_ca: Optional[bytes]  # None: the system's roots
    cert: Optional[bytes]
    key: Optional[bytes]

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca,
                                            private_key=self.key, certificate_chain=self.cert)


def load_tls(tls: bool, root_ca: PemLike, cert: PemLike, key: PemLike) -> Optional[TlsFiles]:
    """The PEM data when TLS is asked for (`tls` or any PEM given), else None (plaintext)."""
    if not wants_tls(tls, root_ca, cert, key):
        return None
    if (cert is None) != (key is None):
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                            "a TLS client certificate and its key go together")
    return TlsFiles(root_ca=read_pem(root_ca, "TLS root CA"),
                    cert=read_pem(cert, "TLS client certificate"),
                    key=read_pem(key, "TLS client key"))


def wants_tls(tls: bool, root_ca: PemLike, cert: PemLike, key: PemLike) -> bool:
    return tls or root_ca is not None or cert is not None or key is not None


def channel_options(retry: RetryPolicy, tls_server_name: Optional[str],
                    extra: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """gRPC channel arguments: 64 MiB messages, reconnects on the retry policy's schedule, the
    TLS name override, then the caller's `extra` (which win)."""
    options: List[Tuple[str, Any]] = [("grpc.max_receive_message_length", 64 * MiB),
                                      ("grpc.max_send_message_length", 64 * MiB), *extra]
    # A channel whose server went away fails every call fast until it reconnects, and by
    # default gRPC re-resolves the target at most every 30 s and reconnects after 1 s, then
    # x1.6 per failure (a restarted server was first reached ~5 s after it came back): the
    # retries would be spent before it is tried. Reconnect on the policy's schedule.
    defaults = {"grpc.initial_reconnect_backoff_ms": retry.initial_backoff,
                "grpc.max_reconnect_backoff_ms": retry.max_backoff,
                "grpc.dns_min_time_between_resolutions_ms": retry.initial_backoff}
    given = {key for key, _ in extra}
    options += [(key, max(1, int(seconds * 1000))) for key, seconds in defaults.items()
                if key not in given]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options
