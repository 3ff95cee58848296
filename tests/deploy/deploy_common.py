"""Helpers shared by the deployment tests: tool lookup, the metrics contract, PromQL references."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

SKIP = 77  # CTest SKIP_RETURN_CODE

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds to every scraped series, and the bucket bound of histogram buckets.
TARGET_LABELS = {"job", "instance"}
NON_LOSSHEAD_METRICS = {"up"}
# Exported once a micro-batch asks for a token output or the top-k, runs a loss term, or a head
# serves embedding rows: the `losshead` tool's traffic never does (tests/service checks them).
ASKED_ONLY_METRICS = {"losshead_token_output_tokens_total", "losshead_top_k_microbatches_total",
                      "losshead_loss_term_microbatches_total", "losshead_embedding_rows_total",
                      "losshead_embedding_grad_rows_total"}

_METRIC_RE = re.compile(r"\b(losshead_[a-z0-9_]+)\b")
_RECORDED_RE = re.compile(r"\b(losshead:[a-zA-Z0-9_:]+)")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR_RE = re.compile(r"\b(losshead_[a-z0-9_]+|up)\s*\{([^}]*)\}")
_MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def find_tool(name, env_var):
    """Path of a required tool. Missing: exit 1 under CI=true, otherwise skip the test (77)."""
    path = os.environ.get(env_var) or shutil.which(name)
    if path and os.access(path, os.X_OK):
        return path
    if os.environ.get("CI", "").lower() == "true":
        fail(f"{name} not found (CI=true: install it with scripts/install-deps.sh, or set {env_var})")
    print(f"SKIP: {name} not found (install it with scripts/install-deps.sh, or set {env_var})")
    sys.exit(SKIP)


def docs_metrics(repo):
    """{name: (type, {labels})} from the table in docs/metrics.md."""
    metrics = {}
    for line in (Path(repo) / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        labels = set(re.findall(r"`([a-zA-Z_][a-zA-Z0-9_]*)`", cells[2]))
        metrics[name] = (cells[1], labels)
    if not metrics:
        fail("docs/metrics.md lists no metrics")
    return metrics


def undashboarded_metrics(repo):
    """{name: why} from the "Not on the dashboard" table of docs/metrics.md."""
    text = (Path(repo) / "docs" / "metrics.md").read_text()
    section = text.split("## Not on the dashboard", 1)
    if len(section) < 2:
        return {}
    out = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = cells[1]
    return out


def yaml_values(text, key):
    """Values of `key:` in a YAML file, plain or folded/literal block scalars (stdlib only)."""
    lines = text.splitlines()
    out, i = [], 0
    key_re = re.compile(r"^(\s*(?:-\s+)?)" + re.escape(key) + r":\s*(.*)$")
    while i < len(lines):
        m = key_re.match(lines[i])
        if not m or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        column, rest = len(m.group(1)), m.group(2).strip()
        block, j = [], i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > column):
            block.append(lines[j].strip())
            j += 1
        if rest in (">", ">-", "|", "|-"):
            value = " ".join(block)
        else:
            value = " ".join([rest] + block).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
        out.append(value.strip())
        i = j
    return out


def rules_exprs(repo):
    """[(where, expr)] of every rule in deploy/prometheus/rules.yml."""
    text = (Path(repo) / "deploy" / "prometheus" / "rules.yml").read_text()
    exprs = yaml_values(text, "expr")
    if not exprs:
        fail("deploy/prometheus/rules.yml: no expr found")
    return [(f"rules.yml expr #{i + 1}", e) for i, e in enumerate(exprs)]


def recorded_names(repo):
    text = (Path(repo) / "deploy" / "prometheus" / "rules.yml").read_text()
    return set(yaml_values(text, "record"))


def load_dashboard(repo):
    path = Path(repo) / "deploy" / "grafana" / "dashboards" / "losshead.json"
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        fail(f"{path}: invalid JSON: {e}")


def iter_panels(dashboard):
    for panel in dashboard.get("panels", []):
        yield panel
        for sub in panel.get("panels", []):
            yield sub


def dashboard_exprs(dashboard):
    """[(where, expr)] of every panel target and every query variable."""
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                out.append((f"panel '{panel.get('title')}' {target.get('refId')}", target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            out.append((f"variable ${var['name']}", q or ""))
    return out


def strip_strings(expr):
    return _STRING_RE.sub('""', expr)


def metric_names(expr):
    """losshead_* metric names (as written: with _bucket etc.) and `up` referenced by a PromQL expr."""
    bare = strip_strings(expr)
    names = set(_METRIC_RE.findall(bare))
    if re.search(r"\bup\s*[{\[)]|\bup\s*(==|!=|>|<)|\bup\s*$", bare):
        names.add("up")
    return names


def recorded_refs(expr):
    return set(_RECORDED_RE.findall(strip_strings(expr)))


def selector_labels(expr):
    """[(metric, label, value)] of the label matchers written in braces after a metric name."""
    out = []
    for metric, body in _SELECTOR_RE.findall(expr):
        for label, value in _MATCHER_RE.findall(body):
            out.append((metric, label, value))
    return out


def base_metric(name, docs):
    """The documented family a referenced sample name belongs to, or None."""
    if name in docs:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and docs.get(base, ("",))[0] == "histogram":
            return base
    return None


def exported_names(metrics_text):
    """Sample names a /metrics page exports, counting families declared by # TYPE with no sample yet."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            family, kind = parts[2], parts[3] if len(parts) > 3 else ""
            names.add(family)
            if kind in ("histogram", "summary"):
                names.update(family + s for s in HISTOGRAM_SUFFIXES)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, 1)[0])
    return names
