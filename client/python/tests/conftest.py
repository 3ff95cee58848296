"""Fixtures: a losshead-server on a free loopback port for the whole session.

The binary is $LOSSHEAD_SERVER_BIN, else build/server/losshead-server under the repository
root; its backend $LOSSHEAD_SERVER_BACKEND, else cpu (cuda runs the suite against a GPU server). The tests skip only when the variable is unset and the default does not exist.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, List

import pytest
import torch

from _servers import ServerFactory, free_port, server_backend, server_binary
from losshead import Client, LossheadError

@pytest.fixture(scope="session")
def server_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = server_binary()
    log_path = tmp_path_factory.mktemp("server") / "losshead-server.log"
    for attempt in range(3):  # a free port can be taken between probing and binding
        address = f"127.0.0.1:{free_port()}"
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [str(binary), "--listen", address, "--metrics_listen", f"127.0.0.1:{free_port()}",
             "--backend", server_backend()], stdout=log, stderr=subprocess.STDOUT)
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


@pytest.fixture
def servers(tmp_path: "Path") -> Iterator[ServerFactory]:
    """Starts extra servers with their own flags (servers.start(*flags)); stops them after."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
