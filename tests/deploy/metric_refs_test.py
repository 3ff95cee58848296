#!/usr/bin/env python3
"""Every metric the Grafana dashboard and the Prometheus rules use is in the metrics contract.

Extracts the metric names (and the label names of their matchers) from every PromQL expression in
deploy/grafana/dashboards/losshead.json and deploy/prometheus/rules.yml, and fails when
docs/metrics.md does not list one. Every metric docs/metrics.md lists is on the dashboard, or in
its "Not on the dashboard" table with the reason (and nothing in that table is on the dashboard).
Also checks the dashboard's structure: valid JSON, unique panel ids, a $head variable the per-head
panels filter on, the panels operators rely on.
The live test checks the same names against a running server's /metrics.
usage: metric_refs_test.py REPO_ROOT
"""

import sys

from deploy_common import (NON_LOSSHEAD_METRICS, TARGET_LABELS, base_metric, dashboard_exprs,
                           docs_metrics, fail, iter_panels, load_dashboard, metric_names,
                           recorded_names, recorded_refs, rules_exprs, selector_labels,
                           undashboarded_metrics)


def check_dashboard_structure(dash):
    errors = []
    ids = [p.get("id") for p in iter_panels(dash)]
    if len(ids) != len(set(ids)):
        errors.append(f"duplicate panel ids: {ids}")
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    if "head" not in variables or not variables["head"].get("includeAll"):
        errors.append("no $head query variable with an All option")
    if variables.get("datasource", {}).get("type") != "datasource":
        errors.append("no $datasource variable")
    for p in iter_panels(dash):
        if p.get("type") == "row":
            continue
        g = p.get("gridPos", {})
        if g.get("x", 0) + g.get("w", 0) > 24:
            errors.append(f"panel '{p.get('title')}' is wider than the grid")
        if p.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"panel '{p.get('title')}' does not use the $datasource variable")
        targets = p.get("targets", [])
        if not targets or not all(t.get("expr") for t in targets):
            errors.append(f"panel '{p.get('title')}' has a target without a query")
    exprs = " ".join(e for _, e in dashboard_exprs(dash))
    required = {
        "step p50/p95/p99 by phase": all(
            f"histogram_quantile({q}, sum by (le, head, phase) (rate(losshead_step_phase_duration_seconds_bucket"
            in exprs for q in ("0.5", "0.95", "0.99")),
        "tokens/s": "rate(losshead_tokens_total" in exprs,
        "bytes/s in and out": "sum by (method, direction) (rate(losshead_bytes_total" in exprs,
        "device memory by kind": "losshead_device_memory_bytes" in exprs,
        "in-flight micro-batches": "losshead_inflight_microbatches" in exprs,
        "failures by reason": "reason) (rate(losshead_failures_total" in exprs,
        "pull rate": "rate(losshead_pulls_total" in exprs,
        "push rate": "rate(losshead_pushes_total" in exprs,
        "per-head filter": 'head=~"$head"' in exprs,
        "checkpoint age": "time() - max by (instance, head) "
                          "(losshead_checkpoint_last_success_timestamp_seconds" in exprs,
        "optimizer steps by outcome": "rate(losshead_optimizer_applies_total" in exprs,
        "last loss": "losshead_head_last_loss" in exprs,
        "gradient norm": "losshead_optimizer_grad_norm" in exprs,
        "build info": "losshead_build_info" in exprs,
    }
    errors += [f"dashboard lacks: {what}" for what, ok in required.items() if not ok]
    return errors


def check_dashboard_coverage(repo, docs, dash):
    """Every documented metric is on the dashboard or deliberately not, with a reason."""
    errors = []
    on_dashboard = set()
    for _, expr in dashboard_exprs(dash):
        for name in metric_names(expr):
            base = base_metric(name, docs)
            if base is not None:
                on_dashboard.add(base)
    absent = undashboarded_metrics(repo)
    for name in sorted(docs):
        if name not in on_dashboard and name not in absent:
            errors.append(f"{name} (docs/metrics.md) is neither on the dashboard nor in the "
                          "\"Not on the dashboard\" table of docs/metrics.md")
    for name, why in sorted(absent.items()):
        if name not in docs:
            errors.append(f"\"Not on the dashboard\" names {name}, which docs/metrics.md does not "
                          "document")
        elif name in on_dashboard:
            errors.append(f"\"Not on the dashboard\" names {name}, which the dashboard shows")
        if not why:
            errors.append(f"\"Not on the dashboard\" gives no reason for {name}")
    return errors


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else "."
    docs = docs_metrics(repo)
    dash = load_dashboard(repo)
    errors = check_dashboard_structure(dash)
    recorded = recorded_names(repo)
    referenced = {}
    for where, expr in dashboard_exprs(dash) + rules_exprs(repo):
        names = metric_names(expr)
        if not names and not recorded_refs(expr):
            errors.append(f"{where}: references no metric: {expr}")
        for name in names:
            referenced.setdefault(name, where)
            if name in NON_LOSSHEAD_METRICS:
                continue
            if base_metric(name, docs) is None:
                errors.append(f"{where}: {name} is not listed in docs/metrics.md")
        for name in recorded_refs(expr):
            if name not in recorded:
                errors.append(f"{where}: {name} is recorded by no rule in rules.yml")
        for metric, label, _ in selector_labels(expr):
            base = base_metric(metric, docs)
            if base is None:
                continue
            allowed = docs[base][1] | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
            if label not in allowed:
                errors.append(f"{where}: {metric} has no label '{label}' in docs/metrics.md")
    errors += check_dashboard_coverage(repo, docs, dash)
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"OK: {len(referenced)} metric names referenced by the dashboard and rules, all in "
          f"docs/metrics.md: {', '.join(sorted(referenced))}")


if __name__ == "__main__":
    main()
