"""What the package promises about itself: every module it imports is a declared dependency,
a wheel that carries the native library is tagged for that library's platform (one without it
stays pure), and a native library that is missing or does not load is said once, with the
reason and the cost."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Dict, Set

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SOURCE = PACKAGE_DIR / "src" / "losshead"
REPO = PACKAGE_DIR.parents[1]
NATIVE = REPO / "build" / "client" / "capi" / "liblosshead_capi.so"

# Distribution name -> the module it is imported as.
IMPORT_NAMES = {"grpcio": "grpc", "protobuf": "google", "torch": "torch", "numpy": "numpy",
                "transformers": "transformers", "accelerate": "accelerate",
                "safetensors": "safetensors", "pytest": "pytest"}
_STDLIB_FALLBACK = {  # Python < 3.10 has no sys.stdlib_module_names
    "__future__", "abc", "ast", "collections", "contextlib", "copy", "ctypes", "dataclasses",
    "enum", "functools", "glob", "hashlib", "importlib", "inspect", "io", "itertools", "json",
    "math", "os", "pathlib", "pickle", "random", "re", "shutil", "signal", "socket", "struct",
    "subprocess", "sys", "tempfile", "threading", "time", "types", "typing", "uuid", "warnings",
    "weakref", "zlib"}


def _declared() -> Dict[str, Set[str]]:
    """{"": required modules, extra: its modules} from pyproject.toml."""
    text = (PACKAGE_DIR / "pyproject.toml").read_text()
    out: Dict[str, Set[str]] = {}
    required = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)
    assert required is not None
    out[""] = {IMPORT_NAMES[re.split(r"[<>=\[ ]", d)[0]]
               for d in re.findall(r'"([^"]+)"', required.group(1))}
    extras = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(^\[|\Z)", text, re.S | re.M)
    assert extras is not None
    for name, body in re.findall(r"^(\w+) = \[(.*?)\]", extras.group(1), re.S | re.M):
        out[name] = {IMPORT_NAMES[re.split(r"[<>=\[ ]", d)[0]]
                     for d in re.findall(r'"([^"]+)"', body)}
    return out


def _guards_import(node: ast.AST) -> bool:
    """A try whose handler catches ImportError: what it imports is optional by construction."""
    return isinstance(node, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
        for h in node.handlers)


def _imports(path: Path) -> Dict[str, Set[str]]:
    """{"module": top-level imports at module level, "lazy": those inside functions}; imports
    guarded by `except ImportError` are left out."""
    tree = ast.parse(path.read_text())
    found: Dict[str, Set[str]] = {"module": set(), "lazy": set()}

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _guards_import(child):
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found["lazy" if lazy else "module"].add(alias.name.split(".")[0])
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found["lazy" if lazy else "module"].add(child.module.split(".")[0])
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_import_is_a_declared_dependency() -> None:
    stdlib = set(getattr(sys, "stdlib_module_names", _STDLIB_FALLBACK))
    declared = _declared()
    optional = set().union(*(v for k, v in declared.items() if k))
    for path in sorted(SOURCE.rglob("*.py")):
        if "_proto" in path.parts:
            continue  # generated stubs: grpc and protobuf
        imports = _imports(path)
        third_party = {m for m in imports["module"] if m not in stdlib and m != "losshead"}
        assert third_party <= declared[""], f"{path.name} imports {third_party - declared['']}"
        lazy = {m for m in imports["lazy"] if m not in stdlib and m != "losshead"}
        assert lazy <= declared[""] | optional, f"{path.name} imports {lazy} undeclared"


def _build_wheel(source: Path, out: Path, env: Dict[str, str]) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation",
                    "--no-deps", "--no-index", "-w", str(out), str(source)],
                   check=True, env=env, cwd=str(source))
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


@pytest.fixture
def build_env() -> Dict[str, str]:
    # setup.py generates the stubs afresh from LOSSHEAD_PROTO_DIR (below): it needs protoc with
    # grpc_python_plugin, or grpcio-tools, whether or not stubs already lie in the source tree.
    has_protoc = shutil.which("protoc") is not None and shutil.which("grpc_python_plugin")
    if not has_protoc and importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("no protoc + grpc_python_plugin and no grpcio-tools to generate the stubs")
    pytest.importorskip("wheel", reason="building a wheel needs the wheel package")
    env = dict(os.environ)
    env.pop("LOSSHEAD_CAPI_LIB", None)
    env["LOSSHEAD_PROTO_DIR"] = str(REPO / "proto")
    return env


def test_a_wheel_with_the_native_library_is_tagged_for_its_platform(
        tmp_path: Path, build_env: Dict[str, str]) -> None:
    library = Path(os.environ.get("LOSSHEAD_CAPI_LIB", NATIVE))
    if not library.is_file():
        pytest.skip(f"no native library built ({library})")
    source = tmp_path / "src"
    shutil.copytree(PACKAGE_DIR, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "liblosshead_capi.so"))
    wheel = _build_wheel(source, tmp_path / "native", dict(build_env,
                                                           LOSSHEAD_CAPI_LIB=str(library)))
    assert wheel.name.endswith(f"-py3-none-{_platform_tag()}.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        assert "losshead/liblosshead_capi.so" in z.namelist()
        metadata = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert re.search(r"^Requires-Dist: numpy", metadata, re.M), metadata


def test_a_wheel_without_it_stays_pure(tmp_path: Path, build_env: Dict[str, str]) -> None:
    # A copy of the package away from the repository's build/, so that no library is found.
    source = tmp_path / "src"
    shutil.copytree(PACKAGE_DIR, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "liblosshead_capi.so"))
    wheel = _build_wheel(source, tmp_path / "pure", build_env)
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]


def _native_warnings(tmp_path: Path, **env: str) -> str:
    code = (
        "import warnings, losshead\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    losshead.native_available(); losshead.native_available()\n"
        "said = [str(w.message) for w in caught\n"
        "        if issubclass(w.category, losshead.NativeLibraryWarning)]\n"
        "print(len(said)); print(said[0] if said else '')\n")
    full = dict(os.environ)
    full.pop("LOSSHEAD_NATIVE", None)
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join([str(SOURCE.parent), full.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd=str(tmp_path), check=True)
    return done.stdout


def test_a_native_library_that_fails_to_load_is_said_once(tmp_path: Path) -> None:
    if not any((SOURCE / "_proto" / "losshead" / "v1").glob("losshead_pb2.py")):
        pytest.skip("the stubs are not generated in the source tree")
    missing = _native_warnings(tmp_path, LOSSHEAD_CAPI_LIB=str(tmp_path / "nowhere.so"))
    count, message = missing.splitlines()[:2]
    assert count == "1"
    assert "nowhere.so does not exist" in message and "3 times slower" in message
    broken = tmp_path / "liblosshead_capi.so"
    broken.write_text("not a library")
    count, message = _native_warnings(tmp_path, LOSSHEAD_CAPI_LIB=str(broken)).splitlines()[:2]
    assert count == "1" and "cannot load" in message
    assert _native_warnings(tmp_path, LOSSHEAD_NATIVE="0").splitlines()[0] == "0"
