#!/usr/bin/env python3
"""A server image killed mid-training comes back on its checkpoint volume with what it last wrote.

The compose file's losshead-server service (its command, its named checkpoint volume at
--checkpoint_dir, its stop grace period) runs as a container of SERVER_IMAGE on the host network
(loopback ports, checkpoints every second), and `losshead demo` on the host trains a head with
server-side AdamW through it. Mid-training the container gets SIGKILL (`docker kill`). Then:
  - the checkpoint left on the volume is exported offline (`losshead export` in a helper container
    of the same image): W, the optimizer's state, the weights version and optimizer step, and
    the demo client's persisted sequence;
  - a new container on the same volume reports SERVING with the head already restored: its
    version is the checkpoint's, and `losshead progress` tells the client exactly what was lost
    (acknowledged == persisted == the checkpoint's sequence: everything above it must be resent);
  - stopped gracefully (drain, final checkpoint, exit 0) and exported again, W, the optimizer
    state, the version and the step equal the checkpoint it restored, bit for bit.
usage: restart_test.py REPO_ROOT CLIENT_BIN --server-image IMAGE
"""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD = "restart"
DEMO = ["--vocab_size=512", "--hidden_size=64", "--tokens_per_step=1024",
        "--chunk_tokens=256", "--steps=100000", "--print_every=1", "--lr=0.01"]


def log(msg):
    print(f"[restart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, timeout=120, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def compose_server(repo):
    """(command, checkpoint mount target, volume name, stop grace seconds) of the compose file."""
    import yaml
    doc = yaml.safe_load((Path(repo) / "deploy" / "compose" / "docker-compose.yml").read_text())
    service = doc["services"]["losshead-server"]
    mounts = [v for v in service.get("volumes", []) if isinstance(v, str)]
    target = next(v.split(":")[1] for v in mounts if v.split(":")[0] in doc.get("volumes", {}))
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
    return service["command"], target, int(grace.group(1))


def read_safetensors(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


class Container:
    def __init__(self, image, volume, target, flags, name):
        self.name = name
        run(["docker", "run", "-d", "--name", name, "--network", "host",
             "-v", f"{volume}:{target}", image, *flags])

    def exit_code(self):
        return int(run(["docker", "inspect", "-f", "{{.State.ExitCode}}", self.name]).stdout)

    def logs(self):
        r = run(["docker", "logs", self.name], check=False)
        return (r.stdout + r.stderr)[-3000:]

    def remove(self):
        run(["docker", "rm", "-f", self.name], check=False)


def main(argv):
    if len(argv) != 4 or argv[2] != "--server-image":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    repo, client_bin, image = argv[0], str(Path(argv[1]).resolve()), argv[3]
    command, target, grace = compose_server(repo)
    grpc, metrics = free_port(), free_port()
    server = f"127.0.0.1:{grpc}"
    # The compose service's flags, with loopback ports, the image's backend and 1 s checkpoints.
    flags = ["--flagfile=/etc/losshead/backend.flags"]
    for f in command:
        name = f.split("=", 1)[0]
        if name in ("--listen", "--metrics_listen", "--backend", "--checkpoint_interval"):
            continue
        flags.append(f)
    flags += [f"--listen={server}", f"--metrics_listen=127.0.0.1:{metrics}",
              "--checkpoint_interval=1s"]
    assert f"--checkpoint_dir={target}" in flags, f"compose's --checkpoint_dir is not {target}"
    volume = f"losshead-restart-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="losshead-restart-"))
    os.chmod(tmp, 0o777)  # the helper container writes exports here as uid 10001
    run(["docker", "volume", "create", volume])
    containers, demo = [], None

    def cli(*args, check=True):
        return run([client_bin, *args, f"--server={server}"], check=check)

    def wait_serving(container):
        deadline = time.monotonic() + 120
        while cli("health", check=False).returncode != 0:
            state = run(["docker", "inspect", "-f", "{{.State.Running}}", container.name]).stdout
            if state.strip() != "true" or time.monotonic() > deadline:
                raise AssertionError(f"the server did not serve:\n{container.logs()}")
            time.sleep(0.1)

    def export(name):
        run(["docker", "run", "--rm", "--network", "none", "-v", f"{volume}:{target}:ro",
             "-v", f"{tmp}:/out", "--entrypoint", "/usr/local/bin/losshead", image, "export",
             f"--checkpoint={target}", f"--head={HEAD}", f"--out=/out/{name}.safetensors",
             "--with_optimizer"])
        return (json.loads((tmp / f"{name}.manifest.json").read_text()),
                read_safetensors(tmp / f"{name}.safetensors"))

    try:
        first = Container(image, volume, target, flags, f"{volume}-1")
        containers.append(first)
        wait_serving(first)
        log(f"{image} serving on {server}, checkpoints on volume {volume} at {target}")
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
        run(["docker", "kill", "--signal=KILL", first.name])
        log(f"killed the server (SIGKILL) after {steps} optimizer steps of the demo")
        time.sleep(1)
        demo.kill()
        demo.wait()
        demo_log.close()

        before, tensors = export("before")
        record = {c["client_id"]: c["persisted_sequence"] for c in before["clients"]}
        assert client_id in record and record[client_id] >= 1, f"checkpoint clients {record}"
        assert before["optimizer"] == "adamw" and before["optimizer_step"] >= 1, before
        assert sorted(tensors) == ["lm_head.weight", "lm_head.weight.optimizer.exp_avg",
                                   "lm_head.weight.optimizer.exp_avg_sq"], sorted(tensors)
        log(f"checkpoint on the volume: version {before['weights_version']}, AdamW step "
            f"{before['optimizer_step']}, {client_id} persisted up to {record[client_id]}")

        first.remove()
        second = Container(image, volume, target, flags, f"{volume}-2")
        containers.append(second)
        wait_serving(second)
        listed = cli("list").stdout
        assert re.search(rf"^{HEAD}\s.*version={before['weights_version']}\s", listed, re.M), \
            f"SERVING without the checkpoint's head: {listed!r}"
        progress = cli("progress", f"--head={HEAD}", f"--client_id={client_id}").stdout
        want = f"acknowledged={record[client_id]} persisted={record[client_id]}"
        assert want in progress, f"progress {progress!r}, want {want}"
        log(f"restarted: {HEAD} back at version {before['weights_version']}; the client "
            f"learns: {progress.strip()} (resend every sequence above {record[client_id]})")

        run(["docker", "stop", "-t", str(grace), second.name], timeout=grace + 30)
        code = second.exit_code()
        assert code == 0, f"graceful stop exited {code}:\n{second.logs()}"
        after, again = export("after")
        for key in ("weights_version", "optimizer_step", "clients", "vocab_size", "hidden_size",
                    "dtype"):
            assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]}"
        for name, data in tensors.items():
            assert again[name] == data, f"{name} changed across the restart"
        digests = {t["name"]: t["sha256"] for t in after["tensors"]}
        assert digests == {n: hashlib.sha256(d).hexdigest() for n, d in tensors.items()}
        log("stopped gracefully (exit 0); W, exp_avg, exp_avg_sq, version and step equal the "
            "checkpoint the server restored")
        print("OK: killed mid-training, restored from the volume, nothing but the uncheckpointed "
              "micro-batches lost, and the client told which")
    except BaseException:
        for c in containers:
            print(f"--- {c.name}:\n{c.logs()}", file=sys.stderr)
        if (tmp / "demo.log").exists():
            print(f"--- demo:\n{(tmp / 'demo.log').read_text()[-2000:]}", file=sys.stderr)
        raise
    finally:
        if demo is not None and demo.poll() is None:
            demo.kill()
        for c in containers:
            c.remove()
        run(["docker", "volume", "rm", volume], check=False)


if __name__ == "__main__":
    main(sys.argv[1:])
