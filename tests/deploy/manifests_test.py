#!/usr/bin/env python3
"""The compose stack and the Kubernetes manifests agree with the server and with each other.

Static, stdlib only (PyYAML, when present, also checks that every file parses): ports 50051/9464,
the GPU request, gRPC probes, a termination grace period above --drain_timeout, scrape wiring
(prometheus.yml, annotations, ServiceMonitor port), Grafana provisioning paths.
usage: manifests_test.py REPO_ROOT
"""

import re
import sys
from pathlib import Path

errors = []


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


def main():
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    d = repo / "deploy"
    compose = (d / "compose" / "docker-compose.yml").read_text()
    k8s = {p.name: p.read_text() for p in sorted((d / "k8s").glob("*.yaml"))}
    prom = (d / "prometheus" / "prometheus.yml").read_text()

    try:
        import yaml  # optional: a full parse where PyYAML is installed
        for path in [d / "compose" / "docker-compose.yml", *sorted((d / "k8s").glob("*.yaml")),
                     *sorted((d / "grafana" / "provisioning").rglob("*.yml"))]:
            try:
                list(yaml.safe_load_all(path.read_text()))
            except yaml.YAMLError as e:
                errors.append(f"{path}: {e}")
    except ImportError:
        print("note: PyYAML not installed, YAML syntax left to promtool and the regex checks")

    # Compose: GPU reservation, ports, drain margin, mounts.
    check(re.search(r"reservations:\s*\n\s*devices:\s*\n\s*- driver: nvidia", compose),
          "compose: no deploy.resources.reservations.devices nvidia GPU reservation")
    check(re.search(r"capabilities:\s*\[gpu\]", compose), "compose: GPU reservation lacks capabilities [gpu]")
    check('50051:50051"' in compose, "compose: gRPC port 50051 not published")
    drains = re.findall(r"--drain_timeout=(\S+?)\"?$", compose, re.M)
    check(len(drains) == 1, f"compose: expected one --drain_timeout, found {drains}")
    grace = re.search(r"stop_grace_period:\s*(\S+)", compose)
    check(grace, "compose: no stop_grace_period")
    if drains and grace:
        check(seconds(grace.group(1)) >= seconds(drains[0]) + 10,
              f"compose: stop_grace_period {grace.group(1)} leaves < 10s above --drain_timeout={drains[0]}")
    for mount in ("../prometheus:/etc/prometheus", "../grafana/provisioning:/etc/grafana/provisioning",
                  "../grafana/dashboards:/var/lib/grafana/dashboards"):
        check(mount in compose, f"compose: missing mount {mount}")
    check(re.search(r'targets:\s*\["losshead-server:9464"\]', prom),
          "prometheus.yml: does not scrape losshead-server:9464 (the compose service)")
    check(re.search(r"job_name:\s*losshead\s*$", prom, re.M),
          "prometheus.yml: no job named losshead (the rules select job=\"losshead\")")
    provider = (d / "grafana" / "provisioning" / "dashboards" / "losshead.yml").read_text()
    check("/var/lib/grafana/dashboards" in provider, "grafana provider does not read /var/lib/grafana/dashboards")
    datasource = (d / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    check("http://prometheus:9090" in datasource, "grafana datasource does not point at the prometheus service")

    # Kubernetes.
    dep = k8s.get("deployment.yaml", "")
    check(re.search(r"nvidia\.com/gpu:\s*\"?1\"?", dep), "deployment: no nvidia.com/gpu: 1")
    for probe in ("livenessProbe", "readinessProbe"):
        m = re.search(probe + r":\s*\n\s*grpc:\s*\n\s*port:\s*(\d+)", dep)
        check(m and m.group(1) == "50051", f"deployment: {probe} is not a gRPC probe on port 50051")
    drains = re.findall(r"--drain_timeout=(\S+)", dep)
    tgps = re.search(r"terminationGracePeriodSeconds:\s*(\d+)", dep)
    check(len(drains) == 1 and tgps, "deployment: needs one --drain_timeout arg and terminationGracePeriodSeconds")
    if len(drains) == 1 and tgps:
        check(int(tgps.group(1)) >= seconds(drains[0]) + 10,
              f"deployment: terminationGracePeriodSeconds {tgps.group(1)} leaves < 10s above --drain_timeout={drains[0]}")
        live = re.search(r"livenessProbe:(?:\n\s+.*)*?\n\s+periodSeconds:\s*(\d+)(?:\n\s+.*)*?\n\s+failureThreshold:\s*(\d+)", dep)
        if live:
            check(int(live.group(1)) * int(live.group(2)) > seconds(drains[0]),
                  "deployment: the liveness probe kills a draining server before --drain_timeout")
    for flag in ("--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9464"):
        check(flag in dep, f"deployment: args lack {flag}")
    check(re.search(r"name: grpc\s*\n\s*containerPort: 50051", dep), "deployment: no containerPort grpc 50051")
    check(re.search(r"name: metrics\s*\n\s*containerPort: 9464", dep), "deployment: no containerPort metrics 9464")
    check('prometheus.io/port: "9464"' in dep and 'prometheus.io/scrape: "true"' in dep,
          "deployment: pod template lacks prometheus.io scrape annotations")
    check(re.search(r"runAsNonRoot:\s*true", dep), "deployment: runAsNonRoot not set")
    svc = k8s.get("service.yaml", "")
    check(re.search(r"name: grpc\s*\n\s*port: 50051", svc), "service: no grpc port 50051")
    check(re.search(r"name: metrics\s*\n\s*port: 9464", svc), "service: no metrics port 9464")
    check(re.search(r"^\s*name: losshead\b", svc, re.M), "service: not named losshead (job label of the rules)")
    sm = k8s.get("servicemonitor.yaml", "")
    check("kind: ServiceMonitor" in sm and re.search(r"-\s*port:\s*metrics", sm),
          "servicemonitor: does not scrape the Service port named metrics")
    pdb = k8s.get("pdb.yaml", "")
    check("kind: PodDisruptionBudget" in pdb, "pdb.yaml: no PodDisruptionBudget")
    kustomization = k8s.get("kustomization.yaml", "")
    for name in k8s:
        if name != "kustomization.yaml":
            check(name in kustomization, f"kustomization.yaml does not list {name}")
    # All selectors select the Deployment's Pods.
    pod_labels = re.search(r"template:\s*\n\s*metadata:\s*\n\s*labels:\s*\n((?:\s+\S+: \S+\n)+)", dep)
    if pod_labels:
        labels = dict(re.findall(r"(\S+): (\S+)", pod_labels.group(1)))
        for name, text in (("service.yaml", svc), ("pdb.yaml", pdb)):
            for key, value in re.findall(r"^\s+(app\.kubernetes\.io/\S+): (\S+)$",
                                         text.split("selector:", 1)[-1], re.M):
                check(labels.get(key) == value, f"{name}: selector {key}={value} does not match the Pod labels")
    else:
        errors.append("deployment: no Pod template labels")

    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"OK: compose and {len(k8s)} Kubernetes manifests consistent (ports 50051/9464, GPU, gRPC probes, drain margin)")


if __name__ == "__main__":
    main()
