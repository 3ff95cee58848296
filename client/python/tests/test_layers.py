"""The package's import layering (README.md, "Package layout"), read from its sources.

Every import of a losshead module by another is an edge: at module level, under TYPE_CHECKING
or inside a function. No edge may close a circle (one deferred import is allowed to, and is
named here) and none may point to a higher layer than its own. Checked on the sources with
`ast`, so a circle that only the type checker would follow is caught as well as one that breaks
an import; and then at run time, module by module, in a fresh interpreter. And no source
file grows past 450 lines.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple


_SPEC = importlib.util.find_spec("losshead")
assert _SPEC is not None and _SPEC.origin is not None
PACKAGE = Path(_SPEC.origin).parent
README = Path(__file__).resolve().parent.parent / "README.md"

# Deferred imports (inside a function) that may close a circle, with why. Nothing else may.
DEFERRED_CIRCLES = {
    # OffloadedHead.attach loads a training loop's integration only when one is attached; that
    # integration names OffloadedHead in its annotations.
    ("integrations._offloaded_head", "integrations.hf_trainer"),
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts) or "__init__"


def _modules() -> Dict[str, Path]:
    """Module name relative to the package ("client", "integrations.causal_lm", "__init__")."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "_proto" in path.relative_to(PACKAGE).parts:
            continue  # generated stubs: they import nothing of the package
        name = _name(path)
        found[name or "__init__"] = path
    return found


def _edges(modules: Dict[str, Path]) -> Set[Tuple[str, str, bool]]:
    """(importer, imported, deferred) for every import of a package module by another."""
    def resolve(dotted: str) -> str:
        if dotted == "losshead":
            return "__init__"
        return dotted[len("losshead."):] if dotted.startswith("losshead.") else ""

    edges = set()
    for name, path in modules.items():
        def visit(node: ast.AST, deferred: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
                targets: List[str] = []
                if isinstance(child, ast.Import):
                    targets = [resolve(a.name) for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    assert child.level == 0, f"{name}: relative import"
                    base = resolve(child.module or "")
                    for alias in child.names:
                        sub = f"{base}.{alias.name}" if base != "__init__" else alias.name
                        targets.append(sub if sub in modules else base)
                for target in targets:
                    if target in modules and target != name:
                        edges.add((name, target, inner))
                visit(child, inner)
        visit(ast.parse(path.read_text(), str(path)), False)
    return edges


def _layers() -> List[List[str]]:
    """The README's table, lowest layer first."""
    text = README.read_text()
    section = text[text.index("## Package layout"):]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "README.md: no layer table under 'Package layout'"
    rows: List[str] = []
    for line in block.group(1).strip().splitlines():
        if line[:1].isspace():  # a row's continuation
            rows[-1] += " " + line.strip()
        else:
            rows.append(line.split(":", 1)[1])
    return [[m.strip() for m in row.split(",") if m.strip()] for row in reversed(rows)]


def test_every_module_has_one_layer() -> None:
    listed = [m for layer in _layers() for m in layer]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == sorted(_modules()), "README.md's layer table and the package differ"


def test_imports_point_to_the_same_layer_or_below() -> None:
    layer = {m: i for i, ms in enumerate(_layers()) for m in ms}
    upward = sorted(f"{a} -> {b}" for a, b, _ in _edges(_modules()) if layer[b] > layer[a])
    assert not upward


def test_no_import_circle() -> None:
    graph: Dict[str, Set[str]] = {}
    for a, b, deferred in _edges(_modules()):
        if not (deferred and (a, b) in DEFERRED_CIRCLES):
            graph.setdefault(a, set()).add(b)
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def walk(m: str, path: List[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                walk(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not circles


def test_the_deferred_circles_still_exist() -> None:
    """An allowance that nothing uses any more is removed, not kept."""
    deferred = {(a, b) for a, b, d in _edges(_modules()) if d}
    assert DEFERRED_CIRCLES <= deferred


_PROBE = r"""
import importlib, json, sys, types
from pathlib import Path
package = Path(sys.argv[1])
loaded = {}
for name in json.loads(sys.argv[2]):
    for key in [k for k in sys.modules if k == "losshead" or k.startswith("losshead.")]:
        if not key.startswith("losshead._proto"):
            del sys.modules[key]
    # A bare package, so that losshead/__init__.py (which imports nearly everything) does not
    # run first: what a module's import brings in is then its own.
    stub = types.ModuleType("losshead")
    stub.__path__ = [str(package)]
    sys.modules["losshead"] = stub
    importlib.import_module("losshead." + name)
    loaded[name] = sorted(k[len("losshead."):] for k in sys.modules
                          if k.startswith("losshead.") and not k.startswith("losshead._proto"))
print(json.dumps(loaded))
"""


def test_each_module_imports_alone_and_loads_only_its_layer_and_below() -> None:
    layers = _layers()
    layer = {m: i for i, ms in enumerate(layers) for m in ms}
    # The integrations need no model library to be imported, but are left out of the closure
    # check below the package (they import it by name).
    names = [m for m in sorted(_modules()) if m != "__init__"]
    out = subprocess.run([sys.executable, "-c", _PROBE, str(PACKAGE), json.dumps(names)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    above = {name: [m for m in mods if layer.get(m, -1) > layer[name]]
             for name, mods in loaded.items()}
    assert not {k: v for k, v in above.items() if v}


def test_no_source_file_over_450_lines() -> None:
    """Small files with one job each (the generated stubs aside)."""
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 450}
    assert not long
