"""Starting and stopping real losshead-server processes for the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence

import pytest

from losshead import Client, LossheadError, RetryPolicy

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SERVER_BIN = REPO_ROOT / "build" / "server" / "losshead-server"
NO_RETRY = RetryPolicy(max_attempts=1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_backend() -> str:
    """The servers' backend: $LOSSHEAD_SERVER_BACKEND (`cuda` on a GPU host), else `cpu`."""
    return os.environ.get("LOSSHEAD_SERVER_BACKEND", "cpu")


def on_cuda() -> bool:
    return server_backend() == "cuda"


def device_count(wanted: int, at_least: Optional[int] = None) -> int:
    """How many devices a test's server gets: `wanted` on the CPU backend (its devices are
    virtual), as many GPUs as there are up to `wanted` on CUDA; skips where that is fewer than
    `at_least` (default `wanted`)."""
    if not on_cuda():
        return wanted
    import torch
    count = min(wanted, torch.cuda.device_count())
    needed = wanted if at_least is None else at_least
    if count < needed:
        pytest.skip(f"needs {needed} devices; the CUDA server here has {count}")
    return count


# What a CUDA server rounds that the CPU backend (fp32 from fp32 inputs) does not, as relative
# tolerances: a bf16 head's logits chunk and softmax gradient are kept in bf16 (2^-9 per element,
# CudaBackendOptions::bf16_logits), and an fp32 head at "high" or "medium" multiplies on the
# TF32 or bf16 tensor cores.
CUDA_BF16_ROUNDING_REL = 4e-3
CUDA_TF32_REL = 2e-3


def devices_flag(count: int) -> str:
    """The server flag for devices 0 .. count - 1."""
    return "--devices=" + ",".join(str(i) for i in range(count))


def server_binary() -> Path:
    env = os.environ.get("LOSSHEAD_SERVER_BIN")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"LOSSHEAD_SERVER_BIN={env} does not exist")
        return path
    if not DEFAULT_SERVER_BIN.is_file():
        pytest.skip(f"no server: set LOSSHEAD_SERVER_BIN or build {DEFAULT_SERVER_BIN}")
    return DEFAULT_SERVER_BIN


class ServerProcess:
    """One losshead-server (`server_backend()`, loopback, no metrics endpoint) and its log."""

    def __init__(self, port: int, flags: Sequence[str], log_path: Path) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.flags = list(flags)
        self.log_path = log_path
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen(
            [str(server_binary()), "--listen", self.address, "--metrics_listen", "",
             "--backend", server_backend(), *self.flags],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout: float = 20.0, **client_kwargs: Any) -> "ServerProcess":
        """Polls health (over whatever TLS `client_kwargs` ask for) until SERVING."""
        deadline = time.monotonic() + timeout
        with Client(self.address, retry=NO_RETRY, **client_kwargs) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if probe.health(timeout=1.0) == "SERVING":
                        return self
                except LossheadError:
                    time.sleep(0.02)
        self.stop(signal.SIGKILL)
        pytest.fail(f"losshead-server {self.flags} did not become healthy:\n"
                    f"{self.log_path.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class ServerFactory:
    """start(*flags, port=None, **probe_client_kwargs): a serving ServerProcess; all are
    stopped when the test ends."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self.started: List[ServerProcess] = []

    def spawn(self, *flags: str, port: Optional[int] = None) -> ServerProcess:
        """Starts a server without waiting for it."""
        server = ServerProcess(port or free_port(), flags,
                               self._log_dir / f"server-{len(self.started)}.log")
        self.started.append(server)
        return server

    def start(self, *flags: str, port: Optional[int] = None, **probe: Any) -> ServerProcess:
        return self.spawn(*flags, port=port).wait_serving(**probe)

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()
