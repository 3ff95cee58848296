"""trainer_bench's comparisons and table, in plain Python: `summary` needs neither torch nor
transformers."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional

RUNS = ("local", "offloaded", "save", "resumed")
RUN_TITLES = {"local": "the model's own lm_head",
              "offloaded": "offloaded to losshead",
              "save": "offloaded, saving a checkpoint at step {k}",
              "resumed": "resumed from step {k} in a new process"}


def _write_json(path: str, obj: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# -- comparisons (plain Python: `summary` needs neither torch nor transformers) -----------------
def loss_by_step(result: Dict[str, Any]) -> Dict[int, float]:
    return {int(step): float(loss) for step, loss in result.get("losses", [])}


def compare_losses(a: Dict[int, float], b: Dict[int, float], first: int = 1,
                   tail: int = 10) -> Optional[Dict[str, Any]]:
    """|a - b| over the steps both ran from `first` on: the largest (and where), the mean, and
    the mean over the last `tail` of them."""
    steps = sorted(s for s in set(a) & set(b) if s >= first)
    if not steps:
        return None
    diffs = [abs(a[s] - b[s]) for s in steps]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    last = diffs[-tail:]
    return {"steps": [steps[0], steps[-1]], "count": len(steps), "max_abs": diffs[worst],
            "max_at_step": steps[worst], "max_rel": diffs[worst] / abs(b[steps[worst]] or 1.0),
            "mean_abs": sum(diffs) / len(diffs), "tail": len(last),
            "tail_mean_abs": sum(last) / len(last), "first_abs": diffs[0]}


def compare_tensors(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """a against b (the reference) from their stats: relative L2 difference and largest
    difference over the shared sampled positions, and the relative difference of the norms."""
    if a.get("sample_seed") != b.get("sample_seed") or a.get("shape") != b.get("shape"):
        return {"comparable": False}
    xa, xb = a["sample"], b["sample"]
    n = min(len(xa), len(xb))
    num = math.sqrt(sum((xa[i] - xb[i]) ** 2 for i in range(n)))
    den = math.sqrt(sum(xb[i] ** 2 for i in range(n))) or 1.0
    return {"comparable": True, "samples": n, "rel_l2": num / den,
            "max_abs": max((abs(xa[i] - xb[i]) for i in range(n)), default=0.0),
            "equal_samples": sum(1 for i in range(n) if xa[i] == xb[i]),
            "norm_rel": abs(a["norm"] - b["norm"]) / (b["norm"] or 1.0)}


def compare_trunks(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    per = {k: compare_tensors(a[k], b[k]) for k in b if k in a}
    worst = max(per, key=lambda k: per[k].get("rel_l2", 0.0), default=None)
    return {"parameters": len(per), "worst": worst,
            "worst_rel_l2": per[worst]["rel_l2"] if worst else None}


def comparisons(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    pairs = [("offloaded_vs_local", "offloaded", "local", 1),
             ("save_vs_offloaded", "save", "offloaded", 1)]
    resumed = results.get("resumed")
    if resumed is not None:
        k = int(resumed.get("resumed_from_step", 0))
        pairs.append(("resumed_vs_uninterrupted", "resumed", "save", k + 1))
    for key, a, b, first in pairs:
        if a not in results or b not in results:
            continue
        ra, rb = results[a], results[b]
        entry: Dict[str, Any] = {"a": a, "b": b,
                                 "loss": compare_losses(loss_by_step(ra), loss_by_step(rb), first)}
        if "w" in ra and "w" in rb:
            entry["w"] = compare_tensors(ra["w"], rb["w"])
        if "trunk" in ra and "trunk" in rb:
            entry["trunk"] = compare_trunks(ra["trunk"], rb["trunk"])
        if "head" in ra and "head" in rb:
            entry["optimizer_step"] = [ra["head"]["optimizer_step"], rb["head"]["optimizer_step"]]
        out[key] = entry
    return out


def _gib(mib: Optional[float]) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


def summary_text(results: Dict[str, Dict[str, Any]], compared: Dict[str, Any]) -> str:
    any_result = next(iter(results.values()))
    c = any_result["config"]
    k = results.get("save", {}).get("config", {}).get("save_at") or (
        results.get("resumed", {}).get("resumed_from_step"))
    lines = [
        f"{any_result.get('device', '?')}; " + ", ".join(
            f"{n} {v}" for n, v in sorted(any_result.get("versions", {}).items())),
        f"LlamaForCausalLM V = {c['vocab']}, D = {c['hidden']}, {c['layers']} layers "
        f"(intermediate {c['intermediate']}, {c['heads']} heads / {c['kv_heads']} KV); "
        + (f"{c['ranks']} ranks (DDP, one GPU each; peak memory: the largest rank's; losses: "
           f"rank 0's micro-batches) x " if c.get("ranks", 1) > 1 else "")
        + f"{c['batch']} x {c['seq_len']} = {any_result['tokens_per_step']} tokens per step, "
        f"{c['steps']} steps; fp32 weights, bf16 autocast (Trainer bf16=True); attention "
        f"{any_result.get('attn_implementation')}",
        "",
        "| run | steps run | steps/s | median step (ms) | tokens/s | trainer peak allocated "
        "(GiB) | peak reserved (GiB) | loss: first -> last |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        t, m = r.get("timing", {}), r.get("memory", {})
        losses = r.get("losses") or [[0, float("nan")]]
        title = RUN_TITLES[name].format(k=k)
        rate = t.get("steps_per_s")
        if not rate:
            lines.append(f"| {title} | - | | | | | | |")
            continue
        lines.append(
            f"| {title} | {t['executed_steps']} | {rate:.2f} | {t['median_step_ms']:.1f} | "
            f"{rate * r['tokens_per_step']:,.0f} | {_gib(m.get('peak_allocated_mib'))} | "
            f"{_gib(m.get('peak_reserved_mib'))} | step {losses[0][0]} {losses[0][1]:.4f} -> "
            f"step {losses[-1][0]} {losses[-1][1]:.4f} |")
    lines.append("")
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        t = r.get("timing", {})
        extra = [f"train() {t.get('train_wall_s', 0):.1f} s "
                 f"({t.get('wall_steps_per_s') or 0:.2f} steps/s with everything)",
                 f"first step {t.get('first_step_ms', 0):.0f} ms"]
        for s in t.get("saves", []):
            extra.append(f"checkpoint at step {s['step']}: {s['seconds']:.1f} s")
        if name == "resumed" and "before_first_step_s" in t:
            extra.append(f"loading the checkpoint: {t['before_first_step_s']:.1f} s")
        if "head" in r:
            h = r["head"]
            server = sum(h["server_memory_mib"].values())
            extra.append(f"head at weights version {h['weights_version']}, optimizer step "
                         f"{h['optimizer_step']}; {server / 1024:.2f} GiB on the server "
                         f"({h['device']})")
        lines.append(f"- {name}: " + "; ".join(extra))
    lines.append("")
    texts = {"offloaded_vs_local": "offloaded vs local",
             "save_vs_offloaded": "offloaded vs offloaded again (the save run; run-to-run noise)",
             "resumed_vs_uninterrupted": "resumed vs uninterrupted (the save run)"}
    for key, text in texts.items():
        e = compared.get(key)
        if e is None or e.get("loss") is None:
            continue
        lo = e["loss"]
        line = (f"- {text}, steps {lo['steps'][0]}..{lo['steps'][1]}: max |loss diff| "
                f"{lo['max_abs']:.3g} at step {lo['max_at_step']} ({lo['max_rel']:.3%} of the "
                f"loss), mean {lo['mean_abs']:.3g}, mean over the last {lo['tail']} "
                f"{lo['tail_mean_abs']:.3g}; at step {lo['steps'][0]} {lo['first_abs']:.3g}")
        w = e.get("w")
        if w and w.get("comparable"):
            line += (f". W at the end: relative L2 difference {w['rel_l2']:.3g} over "
                     f"{w['samples']} sampled elements ({w['equal_samples']} equal), norms "
                     f"{w['norm_rel']:.3g} apart")
        trunk = e.get("trunk")
        if trunk and trunk.get("worst"):
            line += (f"; trunk: worst parameter {trunk['worst']} at relative L2 "
                     f"{trunk['worst_rel_l2']:.3g}")
        if "optimizer_step" in e:
            line += f"; head optimizer steps {e['optimizer_step'][0]} / {e['optimizer_step'][1]}"
        lines.append(line)
    return "\n".join(lines)


def load_results(directory: str) -> Dict[str, Dict[str, Any]]:
    results = {}
    for name in RUNS:
        path = os.path.join(directory, f"{name}.json")
        if os.path.isfile(path):
            with open(path) as f:
                results[name] = json.load(f)
    return results


def summarize(directory: str) -> None:
    results = load_results(directory)
    if not results:
        raise SystemExit(f"trainer_bench: no results ({', '.join(RUNS)} .json) in {directory}")
    compared = comparisons(results)
    text = summary_text(results, compared)
    print(text)
    _write_json(os.path.join(directory, "summary.json"), compared)
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(f"\nwritten to {os.path.join(directory, 'summary.md')} and summary.json")


