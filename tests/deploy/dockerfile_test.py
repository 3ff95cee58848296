#!/usr/bin/env python3
"""deploy/Dockerfile builds with the scripts CI runs and produces the runtime image operators expect.

Static (no Docker engine needed): the builder's RUN steps call scripts/install-deps.sh and
scripts/build.sh (the scripts .ci/run reaches through scripts/run-tests.sh); the last stage runs as
a non-root user, has losshead-server as ENTRYPOINT, a HEALTHCHECK running deploy/healthcheck.sh
(`losshead health` on 127.0.0.1:50051, with the TLS flags from LOSSHEAD_HEALTH_* variables) and
EXPOSEs 50051 and 9464; .dockerignore keeps build trees and .git out of the context.
usage: dockerfile_test.py REPO_ROOT
"""

import os
import re
import sys
from pathlib import Path


def instructions(text):
    """[(INSTRUCTION, args)] with line continuations joined and comments dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def main():
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    errors = []
    inst = instructions((repo / "deploy" / "Dockerfile").read_text())
    stages, stage = [], None
    for word, args in inst:
        if word == "FROM":
            stage = {"from": args, "steps": []}
            stages.append(stage)
        elif stage is not None:
            stage["steps"].append((word, args))
    if len(stages) < 2:
        errors.append(f"not multi-stage: {len(stages)} FROM")
    runs = [a for s in stages[:-1] for w, a in s["steps"] if w == "RUN"]
    for script in ("scripts/install-deps.sh", "scripts/build.sh"):
        if not any(re.search(r"(^|[\s;&|(])(\./)?" + re.escape(script) + r"\b", r) for r in runs):
            errors.append(f"no builder RUN step calls {script}")
        if not (repo / script).exists():
            errors.append(f"{script} does not exist")
    # The same scripts CI runs.
    ci = (repo / ".ci" / "run").read_text() if (repo / ".ci" / "run").exists() else ""
    tests_sh = (repo / "scripts" / "run-tests.sh").read_text() if (repo / "scripts" / "run-tests.sh").exists() else ""
    if "scripts/run-tests.sh" in ci:
        for script in ("scripts/install-deps.sh", "scripts/build.sh"):
            if script not in tests_sh:
                errors.append(f"CI (scripts/run-tests.sh) does not call {script} any more")
    # The default (BACKEND=cuda) build asks for the CUDA backend, so a missing compiler fails it.
    if runs and not any(re.search(r"BACKEND\}?\"?\s*=\s*cuda\s*\]\s*&&\s*echo ON", r)
                        and "-DLOSSHEAD_CUDA=" in r for r in runs if "scripts/build.sh" in r):
        errors.append("scripts/build.sh is not asked for the CUDA backend (LOSSHEAD_CUDA=ON "
                      "when BACKEND=cuda)")
    if not re.search(r"^ARG BACKEND=cuda$", (repo / "deploy" / "Dockerfile").read_text(), re.M):
        errors.append("the default BACKEND is not cuda")

    final = stages[-1]["steps"] if stages else []
    last = {}
    for word, args in final:
        last.setdefault(word, []).append(args)
    users = last.get("USER", [])
    if not users or re.match(r"^(root|0)(:|$)", users[-1]):
        errors.append(f"runtime stage runs as root (USER {users[-1] if users else 'unset'})")
    entry = (last.get("ENTRYPOINT") or [""])[-1]
    if "losshead-server" not in entry:
        errors.append(f"ENTRYPOINT is not losshead-server: {entry!r}")
    # The health check is deploy/healthcheck.sh: `losshead health` on 127.0.0.1, the port and TLS
    # from the container's environment (a server with --tls_cert is healthy given the CA).
    health = (last.get("HEALTHCHECK") or [""])[-1]
    if "/usr/local/bin/losshead-healthcheck" not in health:
        errors.append(f"HEALTHCHECK does not run /usr/local/bin/losshead-healthcheck: {health!r}")
    if not any(re.fullmatch(r"deploy/healthcheck\.sh\s+/usr/local/bin/losshead-healthcheck", a)
               for a in last.get("COPY", [])):
        errors.append("the runtime stage does not COPY deploy/healthcheck.sh to "
                      "/usr/local/bin/losshead-healthcheck")
    script_path = repo / "deploy" / "healthcheck.sh"
    script = script_path.read_text() if script_path.exists() else ""
    if not script_path.exists() or not os.access(script_path, os.X_OK):
        errors.append("deploy/healthcheck.sh is missing or not executable")
    elif not (re.search(r"^exec /usr/local/bin/losshead health\b", script, re.M)
              and '"--server=127.0.0.1:${LOSSHEAD_HEALTH_PORT:-50051}"' in script):
        errors.append("deploy/healthcheck.sh does not exec `losshead health "
                      "--server=127.0.0.1:${LOSSHEAD_HEALTH_PORT:-50051}`")
    for flag, var in (("--tls_root_ca", "LOSSHEAD_HEALTH_TLS_ROOT_CA"),
                      ("--tls_server_name", "LOSSHEAD_HEALTH_TLS_SERVER_NAME"),
                      ("--tls_cert", "LOSSHEAD_HEALTH_TLS_CERT"),
                      ("--tls_key", "LOSSHEAD_HEALTH_TLS_KEY")):
        if script and not re.search(rf'"{flag}=\$\{{{var}\b', script):
            errors.append(f"deploy/healthcheck.sh does not pass {flag} from {var}")
    exposed = set(" ".join(last.get("EXPOSE", [])).replace("/tcp", "").split())
    for port in ("50051", "9464"):
        if port not in exposed:
            errors.append(f"port {port} is not EXPOSEd")
    for word, args in final:
        if word == "RUN" and re.search(r"scripts/build\.sh|install-deps\.sh|apt-get install[^|&;]*(-dev\b|build-essential|cmake)", args):
            errors.append(f"runtime stage installs build tools: {args[:120]}")
    cmd = " ".join(last.get("CMD", []))
    for flag in ("--listen=", "--metrics_listen=", "--drain_timeout=",
                 "--checkpoint_dir=/var/lib/losshead/checkpoints"):
        if flag not in cmd:
            errors.append(f"CMD does not set {flag}")
    # The checkpoint directory exists, belongs to the server's user (a fresh named volume takes
    # its owner from it) and is a volume.
    if not any(w == "RUN" and re.search(r"mkdir -p /var/lib/losshead/checkpoints\b.*chown 10001:10001 "
                                        r"/var/lib/losshead/checkpoints", a) for w, a in final):
        errors.append("the runtime stage does not create /var/lib/losshead/checkpoints owned by 10001")
    if "/var/lib/losshead/checkpoints" not in " ".join(last.get("VOLUME", [])):
        errors.append("/var/lib/losshead/checkpoints is not a VOLUME")
    # GPUs: A100 and H100 at least, and the driver CUDA 13 needs, stated and enforced.
    text = (repo / "deploy" / "Dockerfile").read_text()
    archs = re.search(r"^ARG CUDA_ARCHITECTURES=(\S+)$", text, re.M)
    if not archs or not all(re.search(rf"(^|;){a}(-real)?(;|$)", archs.group(1)) for a in ("80", "90")):
        errors.append(f"CUDA_ARCHITECTURES does not build sm_80 and sm_90: {archs and archs.group(1)}")
    if not re.search(r'NVIDIA_REQUIRE_CUDA="cuda>=\$\{CUDA_VERSION\}"', " ".join(last.get("ENV", []))):
        errors.append("the runtime stage does not set NVIDIA_REQUIRE_CUDA from CUDA_VERSION")
    if not re.search(r"driver.*\b580\b", text):
        errors.append("the Dockerfile does not state the minimum driver (R580 for CUDA 13)")

    ignore_path = repo / ".dockerignore"
    ignore = ignore_path.read_text().split() if ignore_path.exists() else []
    for pattern in ("build*/", ".git", ".gpu/"):
        if pattern not in ignore:
            errors.append(f".dockerignore lacks {pattern}")
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"OK: {len(stages)} stages; builder runs scripts/install-deps.sh and scripts/build.sh; "
          f"runtime USER {users[-1]}, ENTRYPOINT {entry}, EXPOSE {' '.join(sorted(exposed))}")


if __name__ == "__main__":
    main()
