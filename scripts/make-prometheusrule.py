#!/usr/bin/env python3
"""Writes deploy/k8s/prometheusrule.yaml: deploy/prometheus/rules.yml as a PrometheusRule.

rules.yml is the one source of the recording and alerting rules (promtool tests it); the
Prometheus Operator takes rules only as PrometheusRule objects, so this wraps its groups, as they
are, in one. Run it after editing rules.yml; `--check` exits 1 when the file is out of date
(tests/deploy/manifests_test.py runs that).

    scripts/make-prometheusrule.py [--check]
"""

import sys
from pathlib import Path

HEADER = """\
# Generated from deploy/prometheus/rules.yml by scripts/make-prometheusrule.py: edit rules.yml,
# then rerun the script (tests/deploy/manifests_test.py fails while the two differ).
# The Prometheus Operator loads it when its ruleSelector matches these labels: add yours.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: losshead
  labels:
    app.kubernetes.io/name: losshead
spec:
"""


def render(repo):
    lines = (Path(repo) / "deploy" / "prometheus" / "rules.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = ["  " + line if line.strip() else "" for line in lines[start:]]
    return HEADER + "\n".join(body) + "\n"


def main():
    repo = Path(__file__).resolve().parent.parent
    out = repo / "deploy" / "k8s" / "prometheusrule.yaml"
    text = render(repo)
    if "--check" in sys.argv[1:]:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date with deploy/prometheus/rules.yml: run "
                  "scripts/make-prometheusrule.py", file=sys.stderr)
            sys.exit(1)
        print(f"{out.relative_to(repo)} matches deploy/prometheus/rules.yml")
        return
    out.write_text(text)
    print(f"wrote {out.relative_to(repo)}")


if __name__ == "__main__":
    main()
