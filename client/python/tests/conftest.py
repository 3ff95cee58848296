"""Fixtures: a CPU-backend losshead-server on a free loopback port for the whole session.

The binary is $LOSSHEAD_SERVER_BIN, else build/server/losshead-server under the repository
root. The tests skip only when the variable is unset and the default does not exist.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, List

import pytest
import torch

from losshead import Client, LossheadError

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SERVER_BIN = REPO_ROOT / "build" / "server" / "losshead-server"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_binary() -> Path:
    env = os.environ.get("LOSSHEAD_SERVER_BIN")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"LOSSHEAD_SERVER_BIN={env} does not exist")
        return path
    if not DEFAULT_SERVER_BIN.is_file():
        pytest.skip(f"no server: set LOSSHEAD_SERVER_BIN or build {DEFAULT_SERVER_BIN}")
    return DEFAULT_SERVER_BIN


@pytest.fixture(scope="session")
def server_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _server_binary()
    log_path = tmp_path_factory.mktemp("server") / "losshead-server.log"
    for attempt in range(3):  # a free port can be taken between probing and binding
        address = f"127.0.0.1:{_free_port()}"
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [str(binary), "--listen", address, "--metrics_listen", f"127.0.0.1:{_free_port()}",
             "--backend", "cpu"], stdout=log, stderr=subprocess.STDOUT)
        client = Client(address)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if client.health(timeout=1.0) == "SERVING":
                        break
                except LossheadError:
                    time.sleep(0.1)
            else:
                proc.kill()
                proc.wait()
                log.close()
                if attempt == 2:
                    pytest.fail(f"losshead-server did not become healthy:\n{log_path.read_text()}")
                continue
        finally:
            client.close()
        try:
            yield address
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        return


@pytest.fixture(scope="session")
def client(server_address: str) -> Iterator[Client]:
    with Client(server_address, client_id="pytest") as c:
        yield c


_names = itertools.count()


@pytest.fixture
def make_head(client: Client, request: pytest.FixtureRequest
              ) -> Iterator[Callable[..., str]]:
    """make_head(V, D, weights=None, dtype=fp32, **create_kwargs) -> head name.

    With `weights` (V x D) the head's W is replaced by them, so tests know W exactly.
    Heads are deleted when the test ends.
    """
    created: List[str] = []

    def make(vocab_size: int, hidden_size: int, weights: "torch.Tensor | None" = None,
             dtype: torch.dtype = torch.float32, **kwargs: object) -> str:
        name = f"t{next(_names)}-{request.node.name}"[:120]
        name = "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in name)
        client.create_head(name, vocab_size, hidden_size, weight_dtype=dtype, **kwargs)
        created.append(name)
        if weights is not None:
            client.upload_weights(name, weights)
        return name

    yield make
    for name in created:
        try:
            client.delete_head(name)
        except LossheadError:
            pass
