#!/usr/bin/env python3
"""The image's health check reports a server with TLS on as healthy, given the CA, and only then.

The server container runs SERVER_IMAGE (`docker run --network host`, loopback ports) with the TLS
and token flags of deploy/compose/docker-compose.remote.yml, its secrets directory (a throwaway CA,
a server certificate for "losshead", a tokens file, made with the openssl CLI) mounted where that
override mounts it, and that override's environment for the health check. Docker runs the image's
own HEALTHCHECK (losshead-healthcheck, every second here) and `docker inspect` reads the verdict:
  - the override's environment (LOSSHEAD_HEALTH_TLS_ROOT_CA, LOSSHEAD_HEALTH_TLS_SERVER_NAME):
    healthy, while the gRPC port refuses plaintext from the host;
  - mTLS (--tls_client_ca) with LOSSHEAD_HEALTH_TLS_CERT and _KEY as well: healthy;
  - no health environment (a plaintext check against a TLS port): unhealthy;
  - a server name the certificate does not hold: unhealthy (the check verifies the server).
usage: health_tls_test.py REPO_ROOT CLIENT_BIN --server-image IMAGE
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SERVICE = "losshead-server"
TOKEN = "writer-token-0123456789abcdef"


def log(msg):
    print(f"[health-tls {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, timeout=120, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def interpolate(value):
    """Compose's ${VAR:-default} / ${VAR:?message} / ${VAR} against this process's environment."""
    def sub(m):
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if os.environ.get(name):
            return os.environ[name]
        assert op != ":?", f"${{{name}}} is required: {arg}"
        return arg if op == ":-" else ""
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(:-|:\?)?([^}]*)\}", sub, str(value))


def remote_override(repo):
    """(TLS and token flags, the secrets mount point, the health check's environment)."""
    path = repo / "deploy" / "compose" / "docker-compose.remote.yml"
    service = yaml.safe_load(path.read_text())["services"][SERVICE]
    flags = [f for f in service["command"]
             if f.split("=", 1)[0] in ("--tls_cert", "--tls_key", "--tls_client_ca",
                                       "--auth_tokens_file")]
    assert {f.split("=", 1)[0] for f in flags} >= {"--tls_cert", "--tls_key"}, f"{path}: {flags}"
    mounts = [v.split(":")[-2] for v in service["volumes"] if "LOSSHEAD_SECRETS_DIR" in v]
    assert len(mounts) == 1, f"{path}: no LOSSHEAD_SECRETS_DIR mount: {service['volumes']}"
    env = {k: interpolate(v) for k, v in (service.get("environment") or {}).items()}
    assert env.get("LOSSHEAD_HEALTH_TLS_ROOT_CA", "").startswith(mounts[0] + "/"), \
        f"{path}: the health check gets no CA from {mounts[0]}: {env}"
    return flags, mounts[0], env


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_secrets(d):
    """ca.crt, tls.crt/.key for "losshead", client.crt/.key, tokens: readable by uid 10001."""
    def cert(name, subject, ext=None):
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
               "-subj", subject, "-keyout", f"{name}.key"]
        if ext is None:
            openssl("req", "-x509", *key, "-days", "2", "-out", f"{name}.crt", cwd=d)
            return
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *key, "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
                cwd=d)

    cert("ca", "/CN=losshead test CA")
    cert("tls", "/CN=losshead", "subjectAltName=DNS:losshead\nextendedKeyUsage=serverAuth\n")
    cert("client", "/CN=health", "extendedKeyUsage=clientAuth\n")
    (d / "tokens").write_text(f"writer {TOKEN}\n")
    os.chmod(d, 0o755)
    for f in d.iterdir():
        os.chmod(f, 0o644)  # throwaway keys: the server runs as uid 10001


def main(argv):
    if len(argv) != 4 or argv[2] != "--server-image":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    repo, client_bin, image = Path(argv[0]).resolve(), str(Path(argv[1]).resolve()), argv[3]
    assert shutil.which("openssl"), "the openssl CLI is needed to make the test certificates"
    tls_flags, secrets, health_env = remote_override(repo)
    tmp = Path(tempfile.mkdtemp(prefix="losshead-health-tls-"))
    containers = []
    host_ca = [f"--tls_root_ca={tmp / 'ca.crt'}", "--tls_server_name=losshead"]

    def start(name, extra_flags, env, start_period="60s"):
        grpc = free_port()
        container = f"losshead-health-tls-{os.getpid()}-{name}"
        env = dict(env, LOSSHEAD_HEALTH_PORT=str(grpc))
        run(["docker", "run", "-d", "--name", container, "--network", "host",
             "-v", f"{tmp}:{secrets}:ro", "--health-interval=1s",
             f"--health-start-period={start_period}", "--health-retries=2",
             *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
             image, "--flagfile=/etc/losshead/backend.flags", f"--listen=127.0.0.1:{grpc}",
             "--metrics_listen=", *tls_flags, *extra_flags])
        containers.append(container)
        return container, f"127.0.0.1:{grpc}"

    def state(container):
        return json.loads(run(["docker", "inspect", "-f", "{{json .State}}", container]).stdout)

    def fail(container, why):
        logs = run(["docker", "logs", container], check=False)
        raise AssertionError(f"{container}: {why}\n{json.dumps(state(container)['Health'])}\n"
                             f"{logs.stdout}{logs.stderr}")

    def healthy(container, timeout=60):
        deadline = time.monotonic() + timeout
        while (s := state(container))["Health"]["Status"] != "healthy":
            if not s["Running"] or time.monotonic() > deadline:
                fail(container, f"not healthy: {s['Status']}, {s['Health']['Status']}")
            time.sleep(0.2)

    def unhealthy(container, server, timeout=60):
        """Unhealthy by checks that failed while the server was serving: their last output."""
        deadline = time.monotonic() + timeout
        while run([client_bin, "health", f"--server={server}", "--deadline_s=3", *host_ca],
                  check=False).returncode != 0:
            if not state(container)["Running"] or time.monotonic() > deadline:
                fail(container, "the server did not serve")
            time.sleep(0.2)
        streak = state(container)["Health"]["FailingStreak"]
        while (s := state(container))["Health"]["FailingStreak"] < streak + 2 or \
                s["Health"]["Status"] != "unhealthy":
            if s["Health"]["Status"] == "healthy" or time.monotonic() > deadline:
                fail(container, f"not unhealthy: {s['Health']['Status']}")
            time.sleep(0.2)
        return s["Health"]["Log"][-1]["Output"].strip()

    try:
        make_secrets(tmp)
        log(f"remote override: {' '.join(tls_flags)}; secrets at {secrets}; "
            f"health env {health_env}")

        container, server = start("remote", [], health_env)
        healthy(container)
        run([client_bin, "health", f"--server={server}", *host_ca])
        plain = run([client_bin, "health", f"--server={server}", "--deadline_s=3"], check=False)
        assert plain.returncode != 0, "the gRPC port answered plaintext: TLS is not on"
        log("TLS (the remote override's flags and environment): healthy; plaintext refused")

        mtls_env = dict(health_env, LOSSHEAD_HEALTH_TLS_CERT=f"{secrets}/client.crt",
                        LOSSHEAD_HEALTH_TLS_KEY=f"{secrets}/client.key")
        container, server = start("mtls", [f"--tls_client_ca={secrets}/ca.crt"], mtls_env)
        healthy(container)
        refused = run([client_bin, "health", f"--server={server}", "--deadline_s=3", *host_ca],
                      check=False)
        assert refused.returncode != 0, "the mTLS server answered a client without a certificate"
        log("mTLS (--tls_client_ca, LOSSHEAD_HEALTH_TLS_CERT and _KEY): healthy")

        # A 1 s start period (0 would inherit the image's 60 s): the checks count at once, and
        # unhealthy() waits for two failed ones after SERVING.
        container, server = start("plaintext-check", [], {}, start_period="1s")
        out = unhealthy(container, server)
        log(f"TLS without the health environment: unhealthy ({out})")

        container, server = start("wrong-name", [], dict(
            health_env, LOSSHEAD_HEALTH_TLS_SERVER_NAME="not-losshead"), start_period="1s")
        out = unhealthy(container, server)
        assert "not-losshead" in out, f"the check did not fail on the name: {out!r}"
        log(f"a name the certificate lacks: unhealthy ({out})")
        print("OK: the image's health check speaks TLS (and mTLS) from the container's environment")
    finally:
        for c in containers:
            run(["docker", "rm", "-f", "-v", c], check=False)  # and its anonymous volume
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
