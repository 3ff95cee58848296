"""grpc.health.v1 through generated stubs: the status of the server, and waiting for it."""

from __future__ import annotations

import time
from typing import Optional, Sequence, Tuple

import grpc

from losshead.errors import LossheadError

try:
    # Where grpcio-health-checking is installed, its stubs are the process's copy of the
    # protocol: registering a second one of the same proto file would clash with it.
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-not-found]
except ImportError:
    from losshead._proto.grpc.health.v1 import health_pb2, health_pb2_grpc  # type: ignore

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
Metadata = Optional[Sequence[Tuple[str, str]]]


class HealthProbe:
    """Health/Check on one channel; statuses by name ("SERVING", "NOT_SERVING", ...)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)

    def check(self, service: str = "", *, timeout: Optional[float], metadata: Metadata,
              wait_for_ready: bool = False) -> str:
        """Raises grpc.RpcError like any call."""
        response = self._stub.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=timeout, metadata=metadata,
                                    wait_for_ready=wait_for_ready)
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except ValueError:  # a status newer than this copy of the protocol
            return "UNKNOWN"

    def wait_until_serving(self, target: str, timeout: float, metadata: Metadata) -> None:
        """Polls until SERVING; LossheadError(DEADLINE_EXCEEDED) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = self.check(timeout=1.0, metadata=metadata)
                if last == SERVING:
                    return
            except grpc.RpcError as e:
                last = str(LossheadError.from_rpc_error(e))
            time.sleep(0.05)
        raise LossheadError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{target} not serving after {timeout}s ({last})")
