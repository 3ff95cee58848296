"""Build hook: generate the protobuf and gRPC stubs of the losshead contract.

The contract lives in the repository's ``proto/`` tree (``../../proto`` from here, or
``$LOSSHEAD_PROTO_DIR``). Stubs are written to ``src/losshead/_proto/`` (ignored by git) before
setuptools looks at the package, so regular, wheel and editable installs all carry them.

Code generators, first found wins:
  1. ``$PROTOC`` or ``protoc`` on PATH, with ``$GRPC_PYTHON_PLUGIN`` or ``grpc_python_plugin``;
  2. the ``grpc_tools.protoc`` module (pip package grpcio-tools).

When the proto tree is absent (building from an unpacked sdist or wheel that already holds the
stubs) generation is skipped and the existing stubs are used.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
OUT = HERE / "src" / "losshead" / "_proto"
PROTOS = ["losshead/v1/losshead.proto"]


def _proto_root() -> Path:
    return Path(os.environ.get("LOSSHEAD_PROTO_DIR", HERE.parent.parent / "proto")).resolve()


def _protoc_command(root: Path) -> list[str]:
    protoc = os.environ.get("PROTOC") or shutil.which("protoc")
    plugin = os.environ.get("GRPC_PYTHON_PLUGIN") or shutil.which("grpc_python_plugin")
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc={plugin}", f"-I{root}",
                f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_out={OUT}"]
    if importlib.util.find_spec("grpc_tools") is None:
        raise SystemExit(
            "losshead: cannot generate stubs: need protoc + grpc_python_plugin "
            "(Debian: protobuf-compiler protobuf-compiler-grpc) or the grpcio-tools package")
    return [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}",
            f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}"]


def generate_stubs() -> None:
    root = _proto_root()
    if not (root / PROTOS[0]).is_file():
        if (OUT / "losshead" / "v1" / "losshead_pb2.py").is_file():
            return  # pre-generated (sdist / wheel rebuild)
        raise SystemExit(f"losshead: proto tree not found at {root}; set LOSSHEAD_PROTO_DIR")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    subprocess.run(_protoc_command(root) + [str(root / p) for p in PROTOS], check=True)
    # protoc writes absolute imports (`from losshead.v1 import losshead_pb2`) that would resolve
    # against this very package; make them relative so the stubs live under losshead._proto.
    for path in OUT.rglob("*_pb2_grpc.py"):
        text = path.read_text()
        text = re.sub(r"^from losshead\.v1 import ", "from . import ", text, flags=re.M)
        path.write_text(text)
    for directory in [OUT, *[d for d in OUT.rglob("*") if d.is_dir()]]:
        (directory / "__init__.py").touch()


# Every setup.py invocation (metadata, wheel, editable) regenerates first: setuptools lists the
# package directories while preparing metadata, before any build command could run, and protoc
# takes milliseconds.
generate_stubs()
setup(packages=["losshead", "losshead._proto", "losshead._proto.losshead",
                "losshead._proto.losshead.v1"])
