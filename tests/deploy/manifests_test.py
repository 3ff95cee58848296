#!/usr/bin/env python3
"""The compose stack and the Kubernetes manifests agree with the server and with each other.

Every YAML file parses (PyYAML; required under CI=true, otherwise the structural checks below are
skipped with a note) and every Kubernetes object has the fields its kind requires; `kubectl
kustomize deploy/k8s` builds where kubectl is installed. Then what a deployment that keeps the head
needs:
  compose: a named checkpoint volume behind --checkpoint_dir, no port published beyond loopback by
    default, no default Grafana password, a stop grace period above --drain_timeout, GPU
    reservation, scrape wiring, Grafana provisioning paths, the project name from .env (no
    top-level name:, which compose v1 refuses), a TLS override whose health check is given the CA,
    and `config` accepting both files under every compose CLI installed (v2 `docker compose`, v1
    `docker-compose`);
  Kubernetes: a StatefulSet whose checkpoint directory is a volume claim template, TLS and tokens
    from Secret volumes, probes that work with TLS on (the image's `losshead health` with --tls_root_ca:
    native gRPC probes speak plaintext), a grace period above the drain and the liveness window
    above the drain, a non-root Pod with an fsGroup, a PodDisruptionBudget that lets drains evict,
    a NetworkPolicy that admits only the two ports, a PrometheusRule generated from rules.yml, and
    selectors that select the Pod;
  deploy/k8s/group: a StatefulSet of several processes started in parallel behind a headless
    Service that publishes not-ready Pods, --group_peers a {} pattern of the Pods' names on the
    group port with --group_size its replicas and the rank from the host name, checkpoint sets
    on volume claims (periodic with tokens only beside a group secret), updates on delete, TLS,
    tokens and the group secret from Secret volumes with probes that verify the certificate,
    nothing the server refuses with a group, the NCCL settings, and Pods that admit each other.
usage: manifests_test.py REPO_ROOT
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

errors = []
CHECKPOINT_DIR = "/var/lib/losshead/checkpoints"


def check(ok, msg):
    if not ok:
        errors.append(msg)


def seconds(duration):
    """Seconds of a Go/absl/compose duration such as 30s, 1m30s, 500ms."""
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"bad duration {duration!r}")
    for n, u in parts:
        total += float(n) * units[u]
    return total


def flag(args, name):
    """The value of --name=VALUE in an argument list, or None."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    check(len(values) <= 1, f"--{name} given {len(values)} times")
    return values[0] if values else None


def check_compose(d, compose, docs):
    check(re.search(r"reservations:\s*\n\s*devices:\s*\n\s*- driver: nvidia", compose),
          "compose: no deploy.resources.reservations.devices nvidia GPU reservation")
    check(re.search(r"capabilities:\s*\[gpu\]", compose), "compose: GPU reservation lacks capabilities [gpu]")
    check(re.search(r'50051:50051"', compose), "compose: gRPC port 50051 not published")
    # Nothing is published on every interface unless an operator asks: "HOST_PORT:PORT" alone
    # binds 0.0.0.0.
    for mapping in re.findall(r'^\s*-\s*"?([^"\n]*:\d+:\d+|\d+:\d+)"?\s*$', compose, re.M):
        check(re.match(r"(127\.0\.0\.1|\$\{[A-Z_]+:-127\.0\.0\.1\}):\d+:\d+$", mapping),
              f"compose: port {mapping} is not bound to loopback by default")
    check(re.search(r"GF_SECURITY_ADMIN_PASSWORD:\s*\"\$\{GRAFANA_ADMIN_PASSWORD:\?", compose),
          "compose: Grafana's admin password has a default (use ${GRAFANA_ADMIN_PASSWORD:?...})")
    drains = re.findall(r"--drain_timeout=(\S+?)\"?$", compose, re.M)
    check(len(drains) == 1, f"compose: expected one --drain_timeout, found {drains}")
    grace = re.search(r"stop_grace_period:\s*(\S+)", compose)
    check(grace, "compose: no stop_grace_period")
    if drains and grace:
        check(seconds(grace.group(1)) >= seconds(drains[0]) + 10,
              f"compose: stop_grace_period {grace.group(1)} leaves < 10s above --drain_timeout={drains[0]}")
    check(f"--checkpoint_dir={CHECKPOINT_DIR}" in compose,
          f"compose: the server has no --checkpoint_dir={CHECKPOINT_DIR}")
    check(re.search(r"^\s*-\s*losshead-checkpoints:" + re.escape(CHECKPOINT_DIR) + r"\s*$", compose, re.M)
          and re.search(r"^volumes:(?:\n .*)*\n\s+losshead-checkpoints:", compose, re.M),
          f"compose: no named volume losshead-checkpoints mounted at {CHECKPOINT_DIR}")
    for mount in ("../prometheus:/etc/prometheus", "../grafana/provisioning:/etc/grafana/provisioning",
                  "../grafana/dashboards:/var/lib/grafana/dashboards"):
        check(mount in compose, f"compose: missing mount {mount}")
    prom = (d / "prometheus" / "prometheus.yml").read_text()
    check(re.search(r'targets:\s*\["losshead-server:9464"\]', prom),
          "prometheus.yml: does not scrape losshead-server:9464 (the compose service)")
    check(re.search(r"job_name:\s*losshead\s*$", prom, re.M),
          "prometheus.yml: no job named losshead (the rules select job=\"losshead\")")
    provider = (d / "grafana" / "provisioning" / "dashboards" / "losshead.yml").read_text()
    check("/var/lib/grafana/dashboards" in provider, "grafana provider does not read /var/lib/grafana/dashboards")
    datasource = (d / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    check("http://prometheus:9090" in datasource, "grafana datasource does not point at the prometheus service")
    # The override for remote trainers: TLS and tokens on, and a health check that speaks TLS.
    remote = (d / "compose" / "docker-compose.remote.yml").read_text()
    for name in ("tls_cert", "tls_key", "auth_tokens_file"):
        check(f"--{name}=/etc/losshead/secrets/" in remote, f"docker-compose.remote.yml: no --{name}")
    # The image's health check (deploy/healthcheck.sh) speaks TLS when its environment names the
    # CA; a `test:` here would replace it.
    check(re.search(r"^\s+LOSSHEAD_HEALTH_TLS_ROOT_CA:\s*/etc/losshead/secrets/ca\.crt\s*$", remote,
                    re.M), "docker-compose.remote.yml: the health check is not given the CA "
          "(LOSSHEAD_HEALTH_TLS_ROOT_CA: /etc/losshead/secrets/ca.crt)")
    check(re.search(r"^\s+LOSSHEAD_HEALTH_TLS_SERVER_NAME:", remote, re.M),
          "docker-compose.remote.yml: no LOSSHEAD_HEALTH_TLS_SERVER_NAME for the health check")
    check(not re.search(r"^\s+test:", remote, re.M),
          "docker-compose.remote.yml: a healthcheck test replaces the image's losshead-healthcheck")
    check(remote.count("--drain_timeout=") == 1 and
          re.findall(r"--drain_timeout=(\S+?)\"?$", remote, re.M) == drains,
          "docker-compose.remote.yml: --drain_timeout differs from the base file's")
    # Compose v1 (docker-compose 1.x) refuses a top-level `name:`; the project name, which the
    # checkpoint volume's name starts with, comes from .env next to the file instead.
    check(not re.search(r"^name:", compose, re.M),
          "compose: a top-level name: (compose v1 refuses it; set COMPOSE_PROJECT_NAME in .env)")
    env_file = d / "compose" / ".env"
    check(env_file.exists() and re.search(r"^COMPOSE_PROJECT_NAME=losshead$",
                                          env_file.read_text(), re.M),
          "deploy/compose/.env does not set COMPOSE_PROJECT_NAME=losshead (the volume's prefix)")
    if docs is not None:
        service = docs.get("services", {}).get("losshead-server", {})
        check("losshead-checkpoints" in docs.get("volumes", {}),
              "compose: volumes does not declare losshead-checkpoints")
        check(service.get("healthcheck") is None or "losshead" in str(service["healthcheck"]),
              "compose: the server's healthcheck is not `losshead health`")


# Fields each kind must have (a subset of the API's required fields that a typo would drop).
REQUIRED = {
    "StatefulSet": ["spec.selector", "spec.serviceName", "spec.template.metadata.labels",
                    "spec.template.spec.containers"],
    "Service": ["spec.ports", "spec.selector"],
    "PodDisruptionBudget": ["spec.selector"],
    "NetworkPolicy": ["spec.podSelector"],
    "ServiceMonitor": ["spec.selector", "spec.endpoints"],
    "PrometheusRule": ["spec.groups"],
}


def dig(obj, dotted):
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def selects(selector, labels, where):
    for key, value in (selector or {}).items():
        check(labels.get(key) == value, f"{where}: selector {key}={value} does not match the Pod labels")


def check_pod(sts, services):
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    selects(sts["spec"]["selector"].get("matchLabels"), labels, "statefulset")
    check(sts["spec"].get("replicas") == 1, "statefulset: one replica (one writer of the checkpoints)")
    check(sts["spec"]["serviceName"] in services, "statefulset: serviceName is no Service of these manifests")
    security = spec.get("securityContext", {})
    check(security.get("runAsNonRoot") is True, "statefulset: runAsNonRoot not set")
    check(security.get("fsGroup") == 10001, "statefulset: fsGroup is not the image's group 10001 "
          "(the checkpoint volume would not be writable)")
    (container,) = spec["containers"]
    args = container.get("args", [])
    for a in ("--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464"):
        check(a in args, f"statefulset: args lack {a}")
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    check(ports == {"grpc": 50051, "metrics": 9464}, f"statefulset: container ports {ports}")
    check(str(container["resources"]["limits"].get("nvidia.com/gpu")) == "1" and
          str(container["resources"]["requests"].get("nvidia.com/gpu")) == "1",
          "statefulset: no nvidia.com/gpu: 1")
    annotations = pod["metadata"].get("annotations", {})
    check(annotations.get("prometheus.io/port") == "9464" and annotations.get("prometheus.io/scrape") == "true",
          "statefulset: pod template lacks prometheus.io scrape annotations")

    # Mounts: every one is a volume or a claim template; the checkpoint directory a claim.
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claims = {c["metadata"]["name"]: c for c in sts["spec"].get("volumeClaimTemplates", [])}
    for path, name in mounts.items():
        check(name in volumes or name in claims, f"statefulset: mount {path} names no volume ({name})")
    ckpt = flag(args, "checkpoint_dir")
    check(ckpt == CHECKPOINT_DIR, f"statefulset: --checkpoint_dir is {ckpt}, want {CHECKPOINT_DIR}")
    check(mounts.get(ckpt) in claims, f"statefulset: {ckpt} is not a volume claim template "
          "(an emptyDir or no volume loses the heads with the Pod)")
    for claim in claims.values():
        check(claim["spec"].get("accessModes") == ["ReadWriteOnce"], "checkpoint claim: not ReadWriteOnce")
        check(claim["spec"]["resources"]["requests"].get("storage"), "checkpoint claim: no storage request")
    check(dig(sts, "spec.persistentVolumeClaimRetentionPolicy.whenDeleted") == "Retain",
          "statefulset: deleting it would delete the checkpoint volume")

    # TLS and tokens from Secrets, mounted read-only where the flags point.
    for name in ("tls_cert", "tls_key", "auth_tokens_file"):
        path = flag(args, name)
        check(path, f"statefulset: no --{name}")
        if not path:
            continue
        mount = mounts.get(os.path.dirname(path))
        check(mount in volumes and "secret" in volumes[mount],
              f"statefulset: --{name}={path} is not in a Secret volume")

    # Probes: TLS is on, so the native gRPC probe (plaintext only) cannot be used.
    drain = seconds(flag(args, "drain_timeout") or "0s")
    check(drain > 0, "statefulset: no --drain_timeout")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = container.get(probe)
        check(p is not None, f"statefulset: no {probe}")
        if not p:
            continue
        check("grpc" not in p, f"statefulset: {probe} is a native gRPC probe, which cannot speak TLS")
        cmd = dig(p, "exec.command") or []
        check(cmd[:2] == ["/usr/local/bin/losshead", "health"] and "--server=127.0.0.1:50051" in cmd,
              f"statefulset: {probe} does not run `losshead health --server=127.0.0.1:50051`: {cmd}")
        check(any(c.startswith("--tls_root_ca=") for c in cmd) and
              any(c.startswith("--tls_server_name=") for c in cmd),
              f"statefulset: {probe} does not verify the server's certificate (--tls_root_ca, --tls_server_name)")
        ca = next((c.split("=", 1)[1] for c in cmd if c.startswith("--tls_root_ca=")), "")
        check(mounts.get(os.path.dirname(ca)) in volumes, f"statefulset: {probe}'s CA {ca} is not mounted")
        deadline = next((float(c.split("=", 1)[1]) for c in cmd if c.startswith("--deadline_s=")), None)
        check(deadline is not None and deadline < p.get("timeoutSeconds", 1),
              f"statefulset: {probe}'s --deadline_s is not below its timeoutSeconds")
    live = container.get("livenessProbe", {})
    check(live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > drain,
          "statefulset: the liveness probe kills a draining server before --drain_timeout")
    start = container.get("startupProbe", {})
    check(start.get("periodSeconds", 10) * start.get("failureThreshold", 3) >= 600,
          "statefulset: the startup probe allows less than 10 minutes for the restore")
    tgps = spec.get("terminationGracePeriodSeconds", 30)
    check(tgps >= drain + 60, f"statefulset: terminationGracePeriodSeconds {tgps} leaves < 60s above "
          f"--drain_timeout for the final checkpoint")
    return labels


def check_kubernetes(d, objects):
    by_kind = {}
    for where, obj in objects:
        if not obj:
            continue
        for field in ("apiVersion", "kind", "metadata.name"):
            check(dig(obj, field), f"{where}: no {field}")
        for field in REQUIRED.get(obj.get("kind"), []):
            check(dig(obj, field) is not None, f"{where}: {obj.get('kind')} has no {field}")
        by_kind.setdefault(obj.get("kind"), []).append(obj)
    check("Deployment" not in by_kind, "a Deployment: the server is a StatefulSet with a checkpoint volume")
    for kind in ("StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor",
                 "PrometheusRule"):
        check(len(by_kind.get(kind, [])) == 1, f"expected one {kind}, found {len(by_kind.get(kind, []))}")
    if errors:
        return
    (svc,) = by_kind["Service"]
    labels = check_pod(by_kind["StatefulSet"][0], {svc["metadata"]["name"]})
    check(svc["metadata"]["name"] == "losshead", "service: not named losshead (job label of the rules)")
    check({p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "metrics": 9464},
          "service: ports are not grpc 50051 and metrics 9464")
    selects(svc["spec"]["selector"], labels, "service")
    (sm,) = by_kind["ServiceMonitor"]
    check([e.get("port") for e in sm["spec"]["endpoints"]] == ["metrics"],
          "servicemonitor: does not scrape the Service port named metrics")
    (pdb,) = by_kind["PodDisruptionBudget"]
    selects(pdb["spec"]["selector"].get("matchLabels"), labels, "pdb")
    check("minAvailable" not in pdb["spec"] and pdb["spec"].get("maxUnavailable", 0) >= 1,
          "pdb: a single replica with minAvailable (or maxUnavailable 0) blocks every node drain")
    (np,) = by_kind["NetworkPolicy"]
    selects(np["spec"]["podSelector"].get("matchLabels"), labels, "networkpolicy")
    check("Ingress" in np["spec"].get("policyTypes", []), "networkpolicy: does not restrict ingress")
    ports = sorted(p["port"] for rule in np["spec"].get("ingress", []) for p in rule.get("ports", []))
    check(ports == ["grpc", "metrics"], f"networkpolicy: admits ports {ports}, want grpc and metrics")
    check(all(rule.get("from") for rule in np["spec"].get("ingress", [])),
          "networkpolicy: an ingress rule admits every source")
    (rule,) = by_kind["PrometheusRule"]
    import yaml
    groups = yaml.safe_load((d / "prometheus" / "rules.yml").read_text())["groups"]
    check(rule["spec"]["groups"] == groups, "prometheusrule.yaml: groups differ from rules.yml")


def check_group(d, objects):
    """deploy/k8s/group: a StatefulSet of several processes forming one group (docs/multi-process.md,
    "Membership and bootstrap") behind a headless Service that publishes not-ready Pods."""
    by_kind = {}
    for where, obj in objects:
        if not obj:
            continue
        for field in ("apiVersion", "kind", "metadata.name"):
            check(dig(obj, field), f"group/{where}: no {field}")
        for field in REQUIRED.get(obj.get("kind"), []):
            check(dig(obj, field) is not None, f"group/{where}: {obj.get('kind')} has no {field}")
        by_kind.setdefault(obj.get("kind"), []).append(obj)
    for kind in ("StatefulSet", "Service", "NetworkPolicy"):
        check(len(by_kind.get(kind, [])) == 1,
              f"group: expected one {kind}, found {len(by_kind.get(kind, []))}")
    if errors:
        return
    (sts,), (svc,), (np,) = by_kind["StatefulSet"], by_kind["Service"], by_kind["NetworkPolicy"]
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    pod = sts["spec"]["template"]
    labels, spec = pod["metadata"]["labels"], pod["spec"]
    selects(sts["spec"]["selector"].get("matchLabels"), labels, "group statefulset")
    selects(svc["spec"]["selector"], labels, "group service")
    selects(np["spec"]["podSelector"].get("matchLabels"), labels, "group networkpolicy")
    check(sts["spec"]["serviceName"] == service, "group statefulset: serviceName is not its Service")
    check(svc["spec"].get("clusterIP") == "None", "group service: not headless (clusterIP: None)")
    check(svc["spec"].get("publishNotReadyAddresses") is True,
          "group service: publishNotReadyAddresses is not true (a Pod is Ready only once its group "
          "formed, which needs its peers' names first)")
    check(sts["spec"].get("podManagementPolicy") == "Parallel",
          "group statefulset: podManagementPolicy is not Parallel (each Pod waits for the others)")
    (container,) = spec["containers"]
    args = container.get("args", [])
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    check(ports.get("grpc") == 50051 and ports.get("metrics") == 9464 and "group" in ports,
          f"group statefulset: container ports {ports}")
    check({p["name"]: p["port"] for p in svc["spec"]["ports"]} ==
          {"grpc": 50051, "metrics": 9464, "group": ports.get("group")},
          "group service: ports are not the container's grpc, group and metrics ports")
    replicas = sts["spec"].get("replicas", 1)
    check(replicas >= 2, f"group statefulset: {replicas} replicas is no group")
    size = flag(args, "group_size")
    check(size == str(replicas), f"group statefulset: --group_size={size} but {replicas} replicas")
    peers = flag(args, "group_peers") or ""
    check(re.fullmatch(re.escape(f"{name}-{{}}.{service}.") + r"[^:]+:" + str(ports.get("group")),
                       peers),
          f"group statefulset: --group_peers={peers} is not {name}-{{}}.{service}.<namespace>..."
          f":{ports.get('group')} (the Pods' names through the headless Service, the group port)")
    check(flag(args, "group_rank") is None,
          "group statefulset: --group_rank given (every Pod takes its rank from its host name)")
    if flag(args, "tls_cert") is not None:
        check(flag(args, "group_tls_root_ca") is not None or flag(args, "tls_client_ca") is not None,
              "group statefulset: --tls_cert without --group_tls_root_ca or --tls_client_ca (the "
              "server refuses it: the processes verify each other's certificates)")
    check(sts["spec"].get("updateStrategy", {}).get("type") == "OnDelete",
          "group statefulset: updateStrategy is not OnDelete (a rolling update breaks the group "
          "once per Pod)")
    claims = {c["metadata"]["name"]: c for c in sts["spec"].get("volumeClaimTemplates", [])}
    ckpt = flag(args, "checkpoint_dir")
    ckpt_mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    check(ckpt == CHECKPOINT_DIR and ckpt_mounts.get(ckpt) in claims,
          f"group statefulset: --checkpoint_dir is not {CHECKPOINT_DIR} on a volume claim template "
          "(each process's part of the checkpoint sets)")
    check(dig(sts, "spec.persistentVolumeClaimRetentionPolicy.whenDeleted") == "Retain",
          "group statefulset: deleting it would delete the checkpoint volumes")
    if flag(args, "auth_tokens_file") is not None and flag(args, "group_secret_file") is None:
        check(seconds(flag(args, "checkpoint_interval") or "60s") == 0,
              "group statefulset: periodic checkpoint sets with --auth_tokens_file and no "
              "--group_secret_file (the server refuses them)")
    env = {e["name"]: e for e in container.get("env", [])}
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        check(var in env, f"group statefulset: args use $({var}), which env does not define")
    check(dig(env.get("NCCL_NVLS_ENABLE", {}), "value") == "0", "group statefulset: NCCL_NVLS_ENABLE is not 0")
    check(dig(env.get("NCCL_SOCKET_IFNAME", {}), "value"), "group statefulset: no NCCL_SOCKET_IFNAME")
    check(dig(env.get("NCCL_DEBUG", {}), "value") == "WARN", "group statefulset: NCCL_DEBUG is not WARN")
    drain = seconds(flag(args, "drain_timeout") or "0s")
    bootstrap = seconds(flag(args, "group_bootstrap_timeout") or "120s")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = dig(container.get(probe, {}), "exec.command") or []
        check(cmd[:2] == ["/usr/local/bin/losshead", "health"] and "--server=127.0.0.1:50051" in cmd,
              f"group statefulset: {probe} does not run `losshead health --server=127.0.0.1:50051`")
    start = container.get("startupProbe", {})
    check(start.get("periodSeconds", 10) * start.get("failureThreshold", 3) > bootstrap,
          "group statefulset: the startup probe gives up before --group_bootstrap_timeout")
    live = container.get("livenessProbe", {})
    check(live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > drain,
          "group statefulset: the liveness probe kills a draining server before --drain_timeout")
    check(spec.get("terminationGracePeriodSeconds", 30) >= drain + 10,
          "group statefulset: terminationGracePeriodSeconds leaves < 10s above --drain_timeout")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for path, volume in mounts.items():
        check(volume in volumes or volume in claims,
              f"group statefulset: mount {path} names no volume ({volume})")
    tokens = flag(args, "auth_tokens_file") or ""
    check(mounts.get(os.path.dirname(tokens)) in volumes and
          "secret" in volumes[mounts.get(os.path.dirname(tokens))],
          "group statefulset: no --auth_tokens_file from a Secret volume (plaintext needs tokens)")
    for name in ("tls_cert", "tls_key", "group_tls_root_ca", "tls_client_ca", "group_secret_file"):
        path = flag(args, name)
        if path is None:
            continue
        mount = mounts.get(os.path.dirname(path))
        check(mount in volumes and "secret" in volumes[mount],
              f"group statefulset: --{name}={path} is not in a Secret volume")
    check(flag(args, "group_secret_file") is not None,
          "group statefulset: no --group_secret_file (any process could join the group's mesh)")
    check("--group_mesh_encryption" in args,
          "group statefulset: no --group_mesh_encryption (the mesh's bytes cross the network "
          "between nodes in the clear)")
    if flag(args, "tls_cert") is not None:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = dig(container.get(probe, {}), "exec.command") or []
            ca = next((c.split("=", 1)[1] for c in cmd if c.startswith("--tls_root_ca=")), "")
            check(ca and mounts.get(os.path.dirname(ca)) in volumes and
                  any(c.startswith("--tls_server_name=") for c in cmd),
                  f"group statefulset: {probe} does not verify the server's certificate "
                  "(--tls_root_ca from a mounted Secret, --tls_server_name)")
    peer_rule = [r for r in np["spec"].get("ingress", [])
                 if any(dig(f, "podSelector.matchLabels") == labels for f in r.get("from", []))]
    check(peer_rule and not peer_rule[0].get("ports"),
          "group networkpolicy: the group's Pods do not admit each other on every port (NCCL)")


def compose_clis():
    """The compose CLIs installed here: v2 (`docker compose`) and v1 (`docker-compose`)."""
    clis = []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        clis.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        clis.append(["docker-compose"])
    return clis


def check_compose_clis(d):
    """`config` of every installed compose CLI accepts the stack, alone and with the override."""
    clis = compose_clis()
    if not clis:
        print("note: neither `docker compose` nor `docker-compose` installed: `config` not tried")
    env = dict(os.environ, GRAFANA_ADMIN_PASSWORD="x", LOSSHEAD_SECRETS_DIR="/etc/losshead")
    env.pop("COMPOSE_PROJECT_NAME", None)
    base, remote = d / "compose" / "docker-compose.yml", d / "compose" / "docker-compose.remote.yml"
    for cli in clis:
        for files in ([base], [base, remote]):
            argv = [*cli, *[a for f in files for a in ("-f", str(f))], "config"]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
            if r.returncode != 0:
                errors.append(f"{' '.join(argv)}: {r.stderr.strip()}")
                continue
            # v2 prints the project name; the volume is <project>_losshead-checkpoints.
            name = re.search(r"^name:\s*(\S+)", r.stdout, re.M)
            check(name is None or name.group(1) == "losshead",
                  f"{' '.join(argv)}: project {name and name.group(1)}, not losshead")


def main():
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    d = repo / "deploy"
    compose = (d / "compose" / "docker-compose.yml").read_text()
    k8s_files = sorted((d / "k8s").glob("*.yaml"))
    kustomization = (d / "k8s" / "kustomization.yaml").read_text()
    for path in k8s_files:
        if path.name != "kustomization.yaml":
            check(re.search(r"^\s*-\s*" + re.escape(path.name) + r"\s*$", kustomization, re.M),
                  f"kustomization.yaml does not list {path.name}")
    r = subprocess.run([sys.executable, str(repo / "scripts" / "make-prometheusrule.py"), "--check"],
                       capture_output=True, text=True)
    check(r.returncode == 0, f"prometheusrule.yaml: {r.stderr.strip()}")

    try:
        import yaml
    except ImportError:
        yaml = None
        if os.environ.get("CI", "").lower() == "true":
            errors.append("PyYAML missing (CI=true: install python3-yaml, scripts/install-deps.sh)")
        print("note: PyYAML not installed: structural checks skipped")
    compose_doc, objects = None, []
    if yaml is not None:
        for path in [d / "compose" / "docker-compose.yml", *k8s_files,
                     *sorted((d / "grafana" / "provisioning").rglob("*.yml"))]:
            try:
                docs = list(yaml.safe_load_all(path.read_text()))
            except yaml.YAMLError as e:
                errors.append(f"{path}: {e}")
                continue
            if path.name == "docker-compose.yml":
                compose_doc = docs[0]
            elif path.parent.name == "k8s" and path.name != "kustomization.yaml":
                objects += [(path.name, doc) for doc in docs]
    check_compose(d, compose, compose_doc)
    if yaml is not None and not errors:
        check_kubernetes(d, objects)
    group_files = sorted((d / "k8s" / "group").glob("*.yaml"))
    group_kustomization = (d / "k8s" / "group" / "kustomization.yaml").read_text()
    for path in group_files:
        if path.name != "kustomization.yaml":
            check(re.search(r"^\s*-\s*" + re.escape(path.name) + r"\s*$", group_kustomization, re.M),
                  f"group/kustomization.yaml does not list {path.name}")
    if yaml is not None and not errors:
        group_objects = []
        for path in group_files:
            if path.name == "kustomization.yaml":
                continue
            try:
                group_objects += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text())]
            except yaml.YAMLError as e:
                errors.append(f"{path}: {e}")
        if not errors:
            check_group(d, group_objects)

    check_compose_clis(d)
    kubectl = shutil.which("kubectl")
    if kubectl:
        r = subprocess.run([kubectl, "kustomize", str(d / "k8s")], capture_output=True, text=True,
                           timeout=60)
        check(r.returncode == 0, f"kubectl kustomize deploy/k8s: {r.stderr.strip()}")
        r = subprocess.run([kubectl, "kustomize", str(d / "k8s" / "group")], capture_output=True,
                           text=True, timeout=60)
        check(r.returncode == 0, f"kubectl kustomize deploy/k8s/group: {r.stderr.strip()}")
    else:
        print("note: kubectl not installed: `kubectl kustomize deploy/k8s` not tried")

    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"OK: compose and {len(k8s_files)} Kubernetes manifests consistent (checkpoint volume, "
          "TLS probes, Secrets, drains, NetworkPolicy, PrometheusRule, ports, grace periods), "
          "and the group's StatefulSet (headless Service, peers, NCCL settings)")


if __name__ == "__main__":
    main()
