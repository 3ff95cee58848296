"""Bearer tokens with reader / writer roles, TLS and mTLS, against real servers.

A throwaway PKI (CA, server certificate for 127.0.0.1 and localhost, client certificate, and a
rogue CA with its own client certificate) is made with the openssl CLI in a temporary directory.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict

import grpc
import pytest
import torch

from _reference import random_problem
from _servers import NO_RETRY, ServerFactory, server_backend
from losshead import Client, LossheadError

C = grpc.StatusCode
READER = "reader-token-0123456789abcdef"
WRITER = "writer-token-fedcba9876543210"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def _cert(d: Path, name: str, subject: str, ca: str = "", ext: str = "") -> None:
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
           "-subj", subject, "-keyout", f"{name}.key"]
    if not ca:
        _openssl("req", "-x509", *key, "-days", "2", "-out", f"{name}.crt", cwd=d)
        return
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", *key, "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
             cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _cert(d, "ca", "/CN=losshead test CA")
    _cert(d, "rogue-ca", "/CN=rogue CA")
    _cert(d, "server", "/CN=localhost", "ca",
          "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _cert(d, "client", "/CN=trainer", "ca", "extendedKeyUsage=clientAuth\n")
    _cert(d, "rogue", "/CN=intruder", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    tokens = d / "tokens"
    tokens.write_text(f"# role token\nreader {READER}\nwriter {WRITER}\n")
    return {name: d / f"{name}.crt" for name in ("ca", "rogue-ca", "server", "client", "rogue")} | {
        "server.key": d / "server.key", "client.key": d / "client.key",
        "rogue.key": d / "rogue.key", "tokens": tokens}


def _code(fn: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(LossheadError) as e:
        fn()
    return e.value.code


# -- bearer tokens -------------------------------------------------------------------------
def test_tokens_and_roles(servers: ServerFactory, pki: Dict[str, Path]) -> None:
    address = servers.start(f"--auth_tokens_file={pki['tokens']}").address
    v, d, n = 12, 8, 10
    hidden, weight, targets = random_problem(n, d, v, seed=60)
    with Client(address) as anonymous, Client(address, token="wrong-token-0123456789") as wrong:
        for c in (anonymous, wrong):
            assert c.health() == "SERVING"  # probes carry no token
            for call in (c.stats, c.list_heads, lambda: c.get_head("lm"),
                         lambda: c.create_head("lm", v, d),
                         lambda: c.step("lm", hidden, targets),
                         lambda: c.pull_gradient("lm"), lambda: c.checkpoint()):
                assert _code(call) == C.UNAUTHENTICATED
            assert c.retries == 0

    with Client(address, token=WRITER, client_id="w") as writer, \
            Client(address, token=READER, client_id="r") as reader:
        writer.create_head("lm", v, d, weight_dtype=torch.float32)
        assert writer.upload_weights("lm", weight) == 2
        r = writer.step("lm", hidden, targets, reduction="sum")
        assert r.token_count == n
        # A reader reads ...
        assert [h.spec.name for h in reader.list_heads()] == ["lm"]
        assert reader.stats().heads[0].tokens_since_pull == n
        assert torch.equal(reader.download_weights("lm").weights, weight)
        assert reader.pull_gradient("lm").summary.token_count == n
        assert reader.client_progress("lm", "w").acknowledged_sequence == r.sequence
        # ... and changes nothing.
        denied = [lambda: reader.step("lm", hidden, targets),
                  lambda: reader.pull_gradient("lm", reset=True),
                  lambda: reader.upload_weights("lm", torch.zeros(v, d)),
                  lambda: reader.create_head("other", v, d),
                  lambda: reader.delete_head("lm"), lambda: reader.checkpoint()]
        for call in denied:
            assert _code(call) == C.PERMISSION_DENIED
        info = writer.get_head("lm")
        assert (info.tokens_since_pull, info.microbatches_since_pull, info.weights_version) == (
            n, 1, 2)
        # The writer may do everything.
        assert writer.pull_gradient("lm", reset=True).summary.token_count == n
        assert _code(writer.checkpoint) == C.FAILED_PRECONDITION  # no --checkpoint_dir: past auth
        writer.delete_head("lm")
        assert writer.list_heads() == []


def test_token_rotation_with_sighup_and_set_token(servers: ServerFactory, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"writer {WRITER}\n")
    server = servers.start(f"--auth_tokens_file={tokens}", "--auth_tokens_reload_interval=0",
                           token=WRITER)
    rotated = "rotated-writer-0123456789abcdef"
    v, d, n = 32, 16, 8
    h, _, t = random_problem(n, d, v, seed=5)
    with Client(server.address, token=WRITER, retry=NO_RETRY, client_id="rot") as c:
        c.create_head("lm", v, d)
        assert c.step("lm", h, t).token_count == n
        # The operator rotates: a new file (renamed over the old one), then SIGHUP.
        staged = tmp_path / "tokens.new"
        staged.write_text(f"writer {rotated}\n")
        staged.replace(tokens)
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "token file reloaded" not in server.log_path.read_text():
            assert time.monotonic() < deadline, server.log_path.read_text()
            time.sleep(0.02)
        assert _code(lambda: c.step("lm", h, t)) == C.UNAUTHENTICATED  # the old token is refused
        c.set_token(rotated)  # same client, same connection
        assert c.step("lm", h, t).token_count == n
        assert c.pull_gradient("lm", reset=True).summary.token_count == 2 * n
        c.set_token(None)
        assert _code(c.stats) == C.UNAUTHENTICATED


# -- TLS -------------------------------------------------------------------------------------
def test_tls(servers: ServerFactory, pki: Dict[str, Path]) -> None:
    tls = {"tls_root_ca": pki["ca"]}
    server = servers.start(f"--tls_cert={pki['server']}", f"--tls_key={pki['server.key']}",
                           **tls)
    port = server.port
    with Client(server.address, tls_root_ca=pki["ca"]) as by_ip:  # a path
        assert by_ip.health() == "SERVING" and by_ip.list_heads() == []
    with Client(f"localhost:{port}", tls_root_ca=pki["ca"].read_bytes()) as by_name:  # PEM bytes
        assert by_name.stats().device.backend == server_backend()
    with Client(server.address, tls_root_ca=str(pki["ca"]), tls_server_name="localhost") as c:
        assert c.list_heads() == []
    # Plaintext, an unknown CA, or a name the certificate does not carry: no connection.
    failing = [Client(server.address, retry=NO_RETRY),
               Client(server.address, retry=NO_RETRY, tls_root_ca=pki["rogue-ca"]),
               Client(server.address, retry=NO_RETRY, tls_root_ca=pki["ca"],
                      tls_server_name="elsewhere.example")]
    for c in failing:
        with c:
            assert _code(c.list_heads) == C.UNAVAILABLE
    # Retried like any UNAVAILABLE, and still UNAVAILABLE.
    with Client(server.address) as plaintext:
        assert _code(plaintext.stats) == C.UNAVAILABLE
        assert plaintext.retries == plaintext.retry.max_attempts - 1


def test_mtls_with_tokens(servers: ServerFactory, pki: Dict[str, Path]) -> None:
    server = servers.start(f"--tls_cert={pki['server']}", f"--tls_key={pki['server.key']}",
                           f"--tls_client_ca={pki['ca']}", f"--auth_tokens_file={pki['tokens']}",
                           tls_root_ca=pki["ca"], tls_cert=pki["client"],
                           tls_key=pki["client.key"])
    ca = {"tls_root_ca": pki["ca"]}
    for kwargs in ({}, {"tls_cert": pki["rogue"], "tls_key": pki["rogue.key"]}):
        with Client(server.address, retry=NO_RETRY, token=WRITER, **ca, **kwargs) as c:
            assert _code(c.list_heads) == C.UNAVAILABLE
    mine = {**ca, "tls_cert": pki["client"], "tls_key": pki["client.key"].read_bytes()}
    with Client(server.address, **mine) as anonymous:
        assert anonymous.health() == "SERVING"
        assert _code(anonymous.list_heads) == C.UNAUTHENTICATED
    with Client(server.address, token=READER, **mine) as reader:
        assert reader.list_heads() == []
        assert _code(lambda: reader.create_head("lm", 4, 4)) == C.PERMISSION_DENIED
    with Client(server.address, token=WRITER, connections=2, **mine) as writer:
        writer.create_head("lm", 7, 4, weight_dtype=torch.float32)
        r = writer.step_chunked("lm", torch.randn(6, 4), torch.randint(0, 7, (6,)),
                                chunk_tokens=2, streams=2)  # both connections carry the token
        assert r.token_count == 6
        assert writer.get_head("lm").microbatches_since_pull == 3


def test_client_side_tls_errors(tmp_path: Path, pki: Dict[str, Path]) -> None:
    assert _code(lambda: Client("127.0.0.1:1", tls_cert=pki["client"])) == C.INVALID_ARGUMENT
    assert _code(lambda: Client("127.0.0.1:1", tls_key=pki["client.key"])) == C.INVALID_ARGUMENT
    with pytest.raises(LossheadError) as e:
        Client("127.0.0.1:1", tls_root_ca=tmp_path / "missing.crt")
    assert e.value.code == C.NOT_FOUND and "missing.crt" in e.value.message
