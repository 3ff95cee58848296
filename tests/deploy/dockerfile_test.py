#!/usr/bin/env python3
"""deploy/Dockerfile builds with the scripts CI runs and produces the runtime image operators expect.

Static (no Docker engine needed): the builder's RUN steps call scripts/install-deps.sh and
scripts/build.sh (the scripts .ci/run reaches through scripts/run-tests.sh); the last stage runs as
a non-root user, has losshead-server as ENTRYPOINT, a `losshead health` HEALTHCHECK on 127.0.0.1:50051
and EXPOSEs 50051 and 9464; .dockerignore keeps build trees and .git out of the context.
usage: dockerfile_test.py REPO_ROOT
"""

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
    health = (last.get("HEALTHCHECK") or [""])[-1]
    if not re.search(r"losshead\"?\s*,?\s*\"?health\b", health) or "127.0.0.1:50051" not in health:
        errors.append(f"HEALTHCHECK does not run `losshead health --server 127.0.0.1:50051`: {health!r}")
    exposed = set(" ".join(last.get("EXPOSE", [])).replace("/tcp", "").split())
    for port in ("50051", "9464"):
        if port not in exposed:
            errors.append(f"port {port} is not EXPOSEd")
    for word, args in final:
        if word == "RUN" and re.search(r"scripts/build\.sh|install-deps\.sh|apt-get install[^|&;]*(-dev\b|build-essential|cmake)", args):
            errors.append(f"runtime stage installs build tools: {args[:120]}")
    cmd = " ".join(last.get("CMD", []))
    for flag in ("--listen=", "--metrics_listen=", "--drain_timeout="):
        if flag not in cmd:
            errors.append(f"CMD does not set {flag}")

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
