#!/usr/bin/env python3
"""promtool check config, check rules and test rules on deploy/prometheus.

usage: promtool_test.py REPO_ROOT   (promtool from PATH or $PROMTOOL; CI=true makes it required)
"""

import subprocess
import sys
from pathlib import Path

from deploy_common import find_tool


def main():
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    promtool = find_tool("promtool", "PROMTOOL")
    prom = repo / "deploy" / "prometheus"
    failed = False
    for args in (["check", "config", "prometheus.yml"],
                 ["check", "rules", "rules.yml"],
                 ["test", "rules", "rules_test.yml"]):
        r = subprocess.run([promtool, *args], cwd=prom, capture_output=True, text=True, timeout=60)
        print(f"$ promtool {' '.join(args)}  -> exit {r.returncode}\n{r.stdout}{r.stderr}")
        failed |= r.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
