#!/usr/bin/env python3
"""Live check of the monitoring stack: losshead-server -> real Prometheus -> dashboard and rule queries.

Starts losshead-server (CPU backend) and Prometheus (1 s scrape, temporary storage, the repository's
rules.yml) on free loopback ports, drives load with `losshead create` + `losshead bench` (Step
streams) and `losshead demo` (pulls and pushes), then asks Prometheus's HTTP API:
  up == 1; rate(losshead_tokens_total) > 0; finite step p99 per phase; device memory gauges > 0;
  every dashboard query evaluates (the load-bearing ones return data); every rule evaluates;
and checks every metric name the dashboard and rules reference is exported by the server's
/metrics. Bounded (~40 s, hard limit 110 s); stops its processes; loopback only.

With --server-image and --prometheus-image the server and Prometheus run as containers of those
images instead (`docker run --network host`, loopback ports; scripts/run-container-tests.sh builds
them): the same checks, plus the server's container runs as the unprivileged user and drains on the
SIGTERM that `docker run` forwards to it. CLIENT_BIN stays on the host, so bench, demo and health
go through the container's published ports.
usage: live_test.py REPO_ROOT SERVER_BIN CLIENT_BIN [--server-image IMAGE --prometheus-image IMAGE]
       (prometheus from PATH or $PROMETHEUS without images)
"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from deploy_common import (ASKED_ONLY_METRICS, NON_LOSSHEAD_METRICS, dashboard_exprs,
                           exported_names, find_tool, load_dashboard, metric_names, rules_exprs)

HARD_LIMIT_S = 110
CONTAINER_HARD_LIMIT_S = 240  # container starts and the image's Prometheus add their own seconds
CONTAINER_UID = "10001"  # the image's losshead user
CONTAINER_CHECKPOINT_DIR = "/var/lib/losshead/checkpoints"  # the image's, owned by that user
HEAD = "deploy-live"
V, D, N = 4096, 256, 256
BENCH_S = 6
RATE_WINDOW = "30s"  # stands in for Grafana's $__rate_interval: several 1 s scrapes
# Dashboard queries that must return data under this load; the rest must evaluate without error.
MUST_HAVE_DATA = ("losshead_tokens_total", "losshead_failures_total", "losshead_pulls_total",
                  "losshead_pushes_total", "losshead_step_phase_duration_seconds_bucket",
                  "losshead_bytes_total", "losshead_device_memory_bytes", "losshead_head_memory_bytes",
                  "losshead_device_busy_seconds_total", "losshead_inflight_microbatches",
                  "losshead_heads", "up{", "losshead_checkpoint_last_success_timestamp_seconds",
                  "losshead_checkpoint_bytes", "losshead_head_weights_version",
                  "losshead_optimizer_grad_norm", "losshead_optimizer_step", "losshead_build_info",
                  "losshead_head_last_loss")


def log(msg):
    print(f"[live {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Stack:
    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []
        self.containers = []

    def start(self, name, argv):
        out = open(Path(self.tmp) / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p, out))
        return p

    def log_tail(self, name, lines=30):
        path = Path(self.tmp) / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start_container(self, name, image, docker_args, args):
        """`docker run` in the foreground: SIGTERM to it reaches the container's process 1."""
        container = f"losshead-live-{name}-{os.getpid()}"
        self.containers.append(container)
        return self.start(name, ["docker", "run", "--rm", "--network", "host", "--name", container,
                                 *docker_args, image, *args]), container

    def stop_all(self):
        for container in self.containers:
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
        for name, p, out in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    log(f"{name} ignored SIGTERM for 15 s: killing it")
                    p.kill()
                    p.wait()
            out.close()


def wait_until(what, predicate, timeout, proc=None, stack=None, name=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{stack.log_tail(name)}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s" + (f"\n{stack.log_tail(name)}" if stack else ""))


class Prom:
    def __init__(self, base):
        self.base = base

    def query(self, expr):
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(http_get(url, timeout=10))
        except urllib.error.HTTPError as e:
            body = json.loads(e.read().decode() or "{}")
        if body.get("status") != "success":
            raise AssertionError(f"query failed: {expr}\n  {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]


def value(sample):
    return float(sample["value"][1])


def run(argv, timeout, what):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    output = (r.stdout + r.stderr).strip()
    if r.returncode != 0:
        raise AssertionError(f"{what} exited with {r.returncode}:\n{output}")
    return output


def parse_args(argv):
    images = {}
    positional = []
    it = iter(argv)
    for a in it:
        if a in ("--server-image", "--prometheus-image"):
            images[a] = next(it, None)
        else:
            positional.append(a)
    if len(positional) != 3 or len(images) not in (0, 2) or None in images.values():
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    return positional, images.get("--server-image"), images.get("--prometheus-image")


def container_uid(container):
    status = run(["docker", "exec", container, "cat", "/proc/1/status"], 30, "docker exec")
    return re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)


def main():
    (repo, server_bin, client_bin), server_image, prom_image = parse_args(sys.argv[1:])
    repo, server_bin, client_bin = (str(Path(a).resolve()) for a in (repo, server_bin, client_bin))
    prometheus = None if prom_image else find_tool("prometheus", "PROMETHEUS")
    for b in ([] if server_image else [server_bin]) + [client_bin]:
        if not os.access(b, os.X_OK):
            print(f"FAIL: {b} is not an executable", file=sys.stderr)
            sys.exit(1)
    limit = CONTAINER_HARD_LIMIT_S if server_image else HARD_LIMIT_S
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"over {limit} s")))
    signal.alarm(limit)

    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="losshead-deploy-live-")
    stack = Stack(tmp)
    ok = False
    try:
        grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port()
        server_addr = f"127.0.0.1:{grpc_port}"
        # Checkpoints every second, for the checkpoint panels and alerts (in the image: its
        # checkpoint directory, owned by the server's user).
        checkpoint_dir = CONTAINER_CHECKPOINT_DIR if server_image else f"{tmp}/checkpoints"
        server_flags = [f"--listen={server_addr}", f"--metrics_listen=127.0.0.1:{metrics_port}",
                        "--drain_timeout=10s", f"--checkpoint_dir={checkpoint_dir}",
                        "--checkpoint_interval=1s"]
        server_container = None
        if server_image:
            # The image's own backend flag file: the CPU variant must start without --backend.
            server, server_container = stack.start_container(
                "server", server_image, [],
                ["--flagfile=/etc/losshead/backend.flags", *server_flags])
        else:
            server = stack.start("server", [server_bin, "--backend=cpu", *server_flags])

        # Prometheus in a container reads the config and rules through a read-only mount.
        config_dir = "/config" if prom_image else tmp
        rules = Path(tmp) / "rules.yml"
        rules.write_text((Path(repo) / "deploy" / "prometheus" / "rules.yml").read_text())
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {json.dumps(config_dir + '/rules.yml')}\n"
            "scrape_configs:\n  - job_name: losshead\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        prom_flags = [f"--config.file={config_dir}/prometheus.yml",
                      f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn",
                      "--storage.tsdb.retention.time=1h"]
        if prom_image:
            for path in (tmp, rules, config):
                os.chmod(path, 0o755 if path == tmp else 0o644)  # the image runs as nobody
            prom_proc, _ = stack.start_container(
                "prometheus", prom_image, ["-v", f"{tmp}:/config:ro"],
                [*prom_flags, "--storage.tsdb.path=/prometheus"])
        else:
            prom_proc = stack.start("prometheus", [prometheus, *prom_flags,
                                                   f"--storage.tsdb.path={tmp}/data"])
        prom = Prom(f"http://127.0.0.1:{prom_port}")

        wait_until("losshead-server health SERVING",
                   lambda: subprocess.run([client_bin, "health", f"--server={server_addr}"],
                                          capture_output=True, timeout=5).returncode == 0,
                   60 if server_image else 30, server, stack, "server")
        log(f"losshead-server SERVING on {server_addr}, metrics on 127.0.0.1:{metrics_port}")
        if server_container:
            uid = container_uid(server_container)
            if uid != CONTAINER_UID:
                raise AssertionError(f"the server's container runs as uid {uid}, want {CONTAINER_UID}")
            log(f"container {server_image} runs losshead-server as uid {uid}")
        wait_until("prometheus ready", lambda: "Ready" in http_get(f"{prom.base}/-/ready"),
                   60 if prom_image else 30, prom_proc, stack, "prometheus")
        # Prometheus applies discovered targets after up to 5 s: load before the first scrape
        # would leave the rate() windows without a baseline.
        wait_until("first scrape of losshead-server",
                   lambda: any(value(s) == 1 for s in prom.query('up{job="losshead"}')),
                   30, prom_proc, stack, "prometheus")
        log(f"prometheus on 127.0.0.1:{prom_port} scrapes losshead-server")

        # /metrics only lists a family once it has a series, and deleting a head drops its
        # series: collect the names exported at any point of the run.
        seen = set()
        sampling = threading.Event()

        def sample_metrics():
            while not sampling.is_set():
                try:
                    seen.update(exported_names(http_get(f"http://127.0.0.1:{metrics_port}/metrics")))
                except OSError:
                    pass
                sampling.wait(0.25)

        sampler = threading.Thread(target=sample_metrics, daemon=True)
        sampler.start()

        # A request that must fail (NOT_FOUND): feeds losshead_failures_total.
        r = subprocess.run([client_bin, "delete", f"--server={server_addr}", "--head=no-such-head"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            raise AssertionError("losshead delete of a missing head succeeded")

        log(run([client_bin, "create", f"--server={server_addr}", f"--head={HEAD}",
                 f"--vocab_size={V}", f"--hidden_size={D}", "--init_std=0.02"], 30, "losshead create"))
        # The client-side optimizer path: it is the one that pulls and pushes.
        demo = stack.start("demo", [client_bin, "demo", f"--server={server_addr}", "--steps=30",
                                    "--print_every=10", "--client_optimizer"])
        # The server-side optimizer (its applies, norms and step count), on a head that stays.
        log(run([client_bin, "demo", f"--server={server_addr}", "--head=deploy-live-adamw",
                 "--steps=10", "--print_every=5", "--keep_head"], 60, "losshead demo (AdamW)"))
        bench_out = run([client_bin, "bench", f"--server={server_addr}", f"--head={HEAD}",
                         f"--chunk_tokens={N}", f"--hidden_size={D}", f"--vocab_size={V}",
                         "--streams=2", f"--seconds={BENCH_S}"],
                        BENCH_S + 40, "losshead bench")
        log("bench:\n  " + bench_out.replace("\n", "\n  "))
        if demo.wait(timeout=60) != 0:
            raise AssertionError(f"losshead demo exited with {demo.returncode}:\n{stack.log_tail('demo')}")
        log("demo: " + stack.log_tail("demo", 1))
        time.sleep(3)  # a few more scrapes and rule evaluations after the load
        sampling.set()
        sampler.join()

        errors = []

        # 1. The server exports every name the dashboard and the rules reference.
        exported = seen | exported_names(http_get(f"http://127.0.0.1:{metrics_port}/metrics"))
        referenced = set()
        for _, expr in dashboard_exprs(load_dashboard(repo)) + rules_exprs(repo):
            referenced |= metric_names(expr)
        # losshead_auth_* exist only with --auth_tokens_file (tests/security checks them).
        missing = sorted(n for n in referenced - NON_LOSSHEAD_METRICS - ASKED_ONLY_METRICS
                         if n not in exported and not n.startswith("losshead_auth_"))
        if missing:
            errors.append(f"/metrics does not export {missing}")
        log(f"/metrics exports all {len(referenced - NON_LOSSHEAD_METRICS)} referenced losshead names"
            if not missing else f"/metrics lacks {missing}")

        # 2. The series the dashboard and the rules stand on, with sane values.
        up = prom.query('up{job="losshead"}')
        if len(up) != 1 or value(up[0]) != 1:
            errors.append(f"up{{job=\"losshead\"}} is {up}, want one series = 1")
        tokens = prom.query(f"sum(rate(losshead_tokens_total[{RATE_WINDOW}]))")
        if not tokens or not value(tokens[0]) > 0:
            errors.append(f"rate(losshead_tokens_total[{RATE_WINDOW}]) is {tokens}, want > 0")
        p99_expr = ("histogram_quantile(0.99, sum by (le, phase) "
                    f"(rate(losshead_step_phase_duration_seconds_bucket{{head=\"{HEAD}\"}}[{RATE_WINDOW}])))")
        p99 = prom.query(p99_expr)
        phases = {s["metric"].get("phase"): value(s) for s in p99}
        for phase in ("receive", "queue", "compute", "send"):
            if phase not in phases or not math.isfinite(phases[phase]) or phases[phase] < 0:
                errors.append(f"step p99 of phase {phase}: {phases.get(phase)}, want finite >= 0")
        memory = {s["metric"]["kind"]: value(s) for s in
                  prom.query("max by (kind) (max_over_time(losshead_device_memory_bytes[1m]))")}
        for kind in ("weights", "gradient"):
            if not memory.get(kind, 0) > 0:
                errors.append(f"losshead_device_memory_bytes{{kind=\"{kind}\"}} = {memory.get(kind)}, want > 0")
        head_memory = prom.query(f'losshead_head_memory_bytes{{head="{HEAD}", kind="weights"}}')
        want_weights = V * D * 2  # bf16
        if not head_memory or value(head_memory[0]) < want_weights:
            errors.append(f"head weights memory {head_memory}, want >= {want_weights} (V x D bf16)")
        pulls = prom.query("sum(max_over_time(losshead_pulls_total[2m]))")
        pushes = prom.query("sum(max_over_time(losshead_pushes_total[2m]))")
        if not pulls or not value(pulls[0]) > 0 or not pushes or not value(pushes[0]) > 0:
            errors.append(f"demo's pulls/pushes not seen: pulls {pulls}, pushes {pushes}")
        failures = prom.query('sum(max_over_time(losshead_failures_total{reason="not_found"}[2m]))')
        if not failures or not value(failures[0]) >= 1:
            errors.append(f"the NOT_FOUND delete is not in losshead_failures_total: {failures}")

        # 3. Every dashboard query evaluates; the load-bearing ones return data.
        empty = []
        for where, expr in dashboard_exprs(load_dashboard(repo)):
            q = expr.replace("$__rate_interval", RATE_WINDOW).replace("$head", ".*")
            if q.startswith("label_values("):
                m = re.match(r"label_values\((\w+),\s*(\w+)\)", q)
                url = f"{prom.base}/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode({"match[]": m.group(1)})
                values = json.loads(http_get(url))["data"]
                if HEAD not in values:
                    errors.append(f"{where}: {expr} gives {values}, want {HEAD} among them")
                continue
            try:
                result = prom.query(q)
            except AssertionError as e:
                errors.append(f"{where}: {e}")
                continue
            if not result:
                empty.append(where)
                if any(k in expr for k in MUST_HAVE_DATA):
                    errors.append(f"{where}: no data for {q}")
        log(f"{len(dashboard_exprs(load_dashboard(repo)))} dashboard queries evaluated; "
            f"empty: {empty or 'none'}")

        # 4. Prometheus evaluated every recording and alerting rule without error.
        groups = json.loads(http_get(f"{prom.base}/api/v1/rules"))["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        bad = [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"]
        if not rules or bad:
            errors.append(f"rules not healthy: {bad or 'none loaded'}")
        firing = [r["name"] for r in rules if r.get("type") == "alerting" and r.get("state") != "inactive"]
        log(f"{len(rules)} rules evaluated ok; alerts not inactive: {firing or 'none'}")

        print(f"\n$ curl -s 'http://127.0.0.1:{prom_port}/api/v1/query' --data-urlencode 'query={p99_expr}'")
        print("{\"status\":\"success\",\"data\":{\"resultType\":\"vector\",\"result\":[\n  "
              + ",\n  ".join(json.dumps(s, separators=(",", ":")) for s in p99) + "]}}")
        print(f"tokens/s (rate over {RATE_WINDOW}): {value(tokens[0]) if tokens else None}; "
              f"device memory bytes by kind: {memory}\n")

        # 5. SIGTERM drains and exits cleanly within --drain_timeout, with a bench in flight.
        draining = stack.start("drain-bench", [client_bin, "bench", f"--server={server_addr}",
                                               f"--head={HEAD}", f"--chunk_tokens={N}",
                                               f"--hidden_size={D}", f"--vocab_size={V}",
                                               "--streams=2", "--seconds=30"])
        wait_until("the drain bench's first micro-batches",
                   lambda: "check ok" in stack.log_tail("drain-bench"), 30, draining, stack,
                   "drain-bench")
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(timeout=20)
            log(f"losshead-server exited {rc} {time.monotonic() - t0:.1f} s after SIGTERM")
            if rc != 0:
                errors.append(f"losshead-server exited {rc} on SIGTERM:\n{stack.log_tail('server')}")
            if "draining" not in stack.log_tail("server", 10):
                errors.append(f"no drain logged after SIGTERM:\n{stack.log_tail('server', 10)}")
            # The bench's streams end (UNAVAILABLE) instead of hanging on a server that is gone.
            draining.wait(timeout=30)
        except subprocess.TimeoutExpired:
            errors.append("losshead-server or its bench still running 20-30 s after SIGTERM "
                          "(--drain_timeout=10s)")

        for e in errors:
            print(f"FAIL: {e}", file=sys.stderr)
        ok = not errors
    except Exception as e:  # noqa: BLE001 - report anything with the logs, then clean up
        print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        for name in ("server", "prometheus"):
            print(f"--- {name} log tail ---\n{stack.log_tail(name)}", file=sys.stderr)
    finally:
        signal.alarm(0)
        stack.stop_all()
        subprocess.run(["rm", "-rf", tmp])
    log(f"{'OK' if ok else 'FAILED'} in {time.monotonic() - started:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
