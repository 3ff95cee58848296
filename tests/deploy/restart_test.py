#!/usr/bin/env python3
"""A server killed mid-training comes back on its compose checkpoint volume with what it last wrote.

Compose itself runs the shipped deploy/compose/docker-compose.yml's losshead-server service (its
named checkpoint volume at --checkpoint_dir, its stop grace period, its restart policy, the image's
health check), with tests/deploy/compose.cpu-test.yml on top: SERVER_IMAGE (the CPU image), the host
network with loopback ports, --backend=cpu and checkpoints every second. Only that service starts:
Prometheus and Grafana come from an image registry, and the server needs neither. The GPU
reservation is taken out of a copy of the base file (no override can remove it under compose v1).
The compose CLI is `docker compose` (v2) when present, else `docker-compose` (v1); the project is a
throwaway one, removed with its volume at the end.

`losshead demo` on the host trains a head with server-side AdamW through the server, and
mid-training `compose kill -s SIGKILL` kills it. Then:
  - the checkpoint left on the volume is exported offline (`losshead export` in a helper container
    of the same image): W, the optimizer's state, the weights version and optimizer step, and
    the demo client's persisted sequence;
  - `compose up` again on the same volume: the server reports SERVING (and the container healthy)
    with the head already restored: its version is the checkpoint's, and `losshead progress` tells
    the client exactly what was lost (acknowledged == persisted == the checkpoint's sequence:
    everything above it must be resent);
  - `compose stop` (drain, final checkpoint, exit 0 within the grace period) and exported again:
    W, the optimizer state, the version and the step equal the checkpoint it restored, bit for bit.
usage: restart_test.py REPO_ROOT CLIENT_BIN --server-image IMAGE
"""

import hashlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HEAD = "restart"
SERVICE = "losshead-server"
VOLUME = "losshead-checkpoints"  # the base file's named volume
# Flags the CPU override changes; every other flag of the base file's command must stay.
CHANGED_FLAGS = ("--listen", "--metrics_listen", "--backend", "--checkpoint_interval")
DEMO = ["--vocab_size=512", "--hidden_size=64", "--tokens_per_step=1024",
        "--chunk_tokens=256", "--steps=100000", "--print_every=1", "--lr=0.01"]


def log(msg):
    print(f"[restart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, timeout=120, check=True, env=None):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def compose_cli():
    """The compose command: `docker compose` (v2, what operators use) if present, else v1."""
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("neither `docker compose` nor `docker-compose` is installed")


def flag_map(command):
    return {f.split("=", 1)[0]: f for f in command}


def cpu_compose_files(repo, tmp):
    """[the base file for a CPU host, the CPU override], the checkpoint dir and the grace seconds.

    The copy of the base file lacks the server's GPU reservation (no NVIDIA runtime here) and its
    published ports (the override puts it on the host network, where compose refuses published
    ports): both are lists, which an override can add to but not empty under compose v1.
    """
    base_path = repo / "deploy" / "compose" / "docker-compose.yml"
    override_path = repo / "tests" / "deploy" / "compose.cpu-test.yml"
    base = yaml.safe_load(base_path.read_text())
    override = yaml.safe_load(override_path.read_text())
    service = base["services"][SERVICE]
    reservations = service["deploy"]["resources"]["reservations"]
    assert [d["driver"] for d in reservations.pop("devices")] == ["nvidia"], reservations
    if not reservations:
        del service["deploy"]["resources"]["reservations"]
    assert all(p.endswith((":50051:50051", ":9464:9464")) for p in service.pop("ports")), base_path
    (tmp / "docker-compose.yml").write_text(yaml.safe_dump(base, sort_keys=False))

    mounts = [v for v in service["volumes"] if isinstance(v, str) and v.startswith(f"{VOLUME}:")]
    assert len(mounts) == 1, f"{base_path}: {VOLUME} is not mounted once: {service['volumes']}"
    target = mounts[0].split(":")[1]
    base_flags = flag_map(service["command"])
    assert base_flags.get("--checkpoint_dir") == f"--checkpoint_dir={target}", \
        f"{base_path}: --checkpoint_dir is not the volume's mount point {target}"
    kept_base, kept_test = ({k: v for k, v in flag_map(command).items() if k not in CHANGED_FLAGS}
                            for command in (service["command"],
                                            override["services"][SERVICE]["command"]))
    assert kept_base == kept_test, \
        f"{override_path} changes more than {CHANGED_FLAGS}: {kept_base} != {kept_test}"
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
    return [tmp / "docker-compose.yml", override_path], target, int(grace.group(1))


def read_safetensors(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def inspect(container, fmt):
    return run(["docker", "inspect", "-f", fmt, container]).stdout.strip()


def main(argv):
    if len(argv) != 4 or argv[2] != "--server-image":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    repo, client_bin, image = Path(argv[0]).resolve(), str(Path(argv[1]).resolve()), argv[3]
    tmp = Path(tempfile.mkdtemp(prefix="losshead-restart-"))
    os.chmod(tmp, 0o777)  # the helper container writes exports here as uid 10001
    files, target, grace = cpu_compose_files(repo, tmp)
    grpc, metrics = free_port(), free_port()
    server = f"127.0.0.1:{grpc}"
    project = f"losshead-restart-{os.getpid()}"
    env = dict(os.environ, LOSSHEAD_IMAGE=image, LOSSHEAD_TEST_GRPC_PORT=str(grpc),
               LOSSHEAD_TEST_METRICS_PORT=str(metrics),
               LOSSHEAD_TEST_MEMLOCK=str(resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
    # Required by the base file's Grafana service, which this test does not start.
    env.setdefault("GRAFANA_ADMIN_PASSWORD", "unused")
    # --project-directory: the base file's relative paths and .env as if it were read in place.
    cli_argv = compose_cli()
    compose_argv = [*cli_argv, "--project-directory", str(repo / "deploy" / "compose"),
                    "-p", project, *[a for f in files for a in ("-f", str(f))]]
    demo, volume, container = None, None, None

    def compose(*args, timeout=180):
        return run([*compose_argv, *args], timeout=timeout, env=env)

    def cli(*args, check=True):
        return run([client_bin, *args, f"--server={server}"], check=check)

    def up():
        """`compose up` of the server alone: (container id, the volume at target)."""
        compose("up", "-d", "--no-build", SERVICE)
        ids = compose("ps", "-a", "-q", SERVICE).stdout.split()
        assert len(ids) == 1, f"compose ps: {ids}"
        mounts = json.loads(inspect(ids[0], "{{json .Mounts}}"))
        names = [m["Name"] for m in mounts if m["Destination"] == target and m["Type"] == "volume"]
        assert len(names) == 1, f"no named volume at {target}: {mounts}"
        return ids[0], names[0]

    def logs():
        r = run([*compose_argv, "logs", "--no-color", SERVICE], check=False, env=env)
        return (r.stdout + r.stderr)[-3000:]

    def wait_serving(container):
        """SERVING from the host, then healthy by the image's own health check."""
        deadline = time.monotonic() + 120
        while cli("health", check=False).returncode != 0:
            if inspect(container, "{{.State.Running}}") != "true" or time.monotonic() > deadline:
                raise AssertionError(f"the server did not serve:\n{logs()}")
            time.sleep(0.1)
        while (health := inspect(container, "{{.State.Health.Status}}")) != "healthy":
            assert health == "starting" and time.monotonic() < deadline, \
                f"serving but {health}: {inspect(container, '{{json .State.Health}}')}"
            time.sleep(0.2)

    def export(name):
        run(["docker", "run", "--rm", "--network", "none", "-v", f"{volume}:{target}:ro",
             "-v", f"{tmp}:/out", "--entrypoint", "/usr/local/bin/losshead", image, "export",
             f"--checkpoint={target}", f"--head={HEAD}", f"--out=/out/{name}.safetensors",
             "--with_optimizer"])
        return (json.loads((tmp / f"{name}.manifest.json").read_text()),
                read_safetensors(tmp / f"{name}.safetensors"))

    try:
        log(f"{' '.join(cli_argv)}: {run([*cli_argv, 'version']).stdout.splitlines()[0]}")
        container, volume = up()
        assert volume == f"{project}_{VOLUME}", f"{volume} is not the project's {VOLUME}"
        wait_serving(container)
        log(f"compose project {project}: {image} serving on {server}, checkpoints on volume "
            f"{volume} at {target}")
        demo_log = open(tmp / "demo.log", "w")
        demo = subprocess.Popen([client_bin, "demo", f"--server={server}", f"--head={HEAD}",
                                 "--keep_head", *DEMO], stdout=demo_log, stderr=subprocess.STDOUT)
        client_id = f"demo-{demo.pid}"
        # Train past a few periodic checkpoints, then kill the server in the middle of a step.
        start = time.monotonic()
        steps = 0
        while steps < 8 or time.monotonic() - start < 5:
            assert demo.poll() is None, (tmp / "demo.log").read_text()[-2000:]
            assert time.monotonic() - start < 120, "the demo made no progress"
            steps = len(re.findall(r"^\s+\d+\s+\d", (tmp / "demo.log").read_text(), re.M))
            time.sleep(0.1)
        compose("kill", "-s", "SIGKILL", SERVICE)
        log(f"killed the server (compose kill -s SIGKILL) after {steps} optimizer steps of "
            "the demo")
        time.sleep(1)
        demo.kill()
        demo.wait()
        demo_log.close()
        state = inspect(container, "{{.State.Status}} {{.State.ExitCode}}")
        assert state == "exited 137", f"after SIGKILL: {state}"

        before, tensors = export("before")
        record = {c["client_id"]: c["persisted_sequence"] for c in before["clients"]}
        assert client_id in record and record[client_id] >= 1, f"checkpoint clients {record}"
        assert before["optimizer"] == "adamw" and before["optimizer_step"] >= 1, before
        assert sorted(tensors) == ["lm_head.weight", "lm_head.weight.optimizer.exp_avg",
                                   "lm_head.weight.optimizer.exp_avg_sq"], sorted(tensors)
        log(f"checkpoint on the volume: version {before['weights_version']}, AdamW step "
            f"{before['optimizer_step']}, {client_id} persisted up to {record[client_id]}")

        container, again_volume = up()
        assert again_volume == volume, f"compose up mounted {again_volume}, not {volume}"
        wait_serving(container)
        listed = cli("list").stdout
        assert re.search(rf"^{HEAD}\s.*version={before['weights_version']}\s", listed, re.M), \
            f"SERVING without the checkpoint's head: {listed!r}"
        progress = cli("progress", f"--head={HEAD}", f"--client_id={client_id}").stdout
        want = f"acknowledged={record[client_id]} persisted={record[client_id]}"
        assert want in progress, f"progress {progress!r}, want {want}"
        log(f"compose up again: {HEAD} back at version {before['weights_version']}, container "
            f"healthy; the client learns: {progress.strip()} (resend every sequence above "
            f"{record[client_id]})")

        # No -t: compose waits the file's stop_grace_period.
        started = time.monotonic()
        compose("stop", SERVICE, timeout=grace + 30)
        state = inspect(container, "{{.State.Status}} {{.State.ExitCode}}")
        assert state == "exited 0", f"graceful stop: {state}:\n{logs()}"
        log(f"compose stop: drained and exited 0 in {time.monotonic() - started:.1f}s "
            f"(grace {grace}s)")
        after, again = export("after")
        for key in ("weights_version", "optimizer_step", "clients", "vocab_size", "hidden_size",
                    "dtype"):
            assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]}"
        for name, data in tensors.items():
            assert again[name] == data, f"{name} changed across the restart"
        digests = {t["name"]: t["sha256"] for t in after["tensors"]}
        assert digests == {n: hashlib.sha256(d).hexdigest() for n, d in tensors.items()}
        log("W, exp_avg, exp_avg_sq, version and step equal the checkpoint the server restored")
        print("OK: killed mid-training, restored from the compose volume, nothing but the "
              "uncheckpointed micro-batches lost, and the client told which")
    except BaseException:
        print(f"--- {SERVICE}:\n{logs()}", file=sys.stderr)
        if (tmp / "demo.log").exists():
            print(f"--- demo:\n{(tmp / 'demo.log').read_text()[-2000:]}", file=sys.stderr)
        raise
    finally:
        if demo is not None and demo.poll() is None:
            demo.kill()
        # The throwaway project's container and its checkpoint volume.
        run([*compose_argv, "down", "-v", "--timeout", "1"], check=False, timeout=120, env=env)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
