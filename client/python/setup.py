"""Build hook: generate the protobuf and gRPC stubs, and carry the native library if built.

Stubs: the losshead contract lives in the repository's ``proto/`` tree (``../../proto`` from
here, or ``$LOSSHEAD_PROTO_DIR``); the standard grpc.health.v1 protocol, which no Debian package
ships, in ``proto/`` beside this file. Both are generated into ``src/losshead/_proto/`` (ignored
by git) before setuptools looks at the package, so regular, wheel and editable installs all
carry them.

Code generators, first found wins:
  1. ``$PROTOC`` or ``protoc`` on PATH, with ``$GRPC_PYTHON_PLUGIN`` or ``grpc_python_plugin``;
  2. the ``grpc_tools.protoc`` module (pip package grpcio-tools).

When the proto tree is absent (building from an unpacked sdist or wheel that already holds the
stubs) generation is skipped and the existing stubs are used.

Native library: ``liblosshead_capi.so`` (the C++ client behind a C ABI, built by CMake as
``build/client/capi/liblosshead_capi.so``) is copied into the package from
``$LOSSHEAD_CAPI_LIB`` when that is set, else from ``../../build/client/capi/`` when it exists.
Without it the package installs all the same and speaks gRPC from Python alone
(``losshead.native_available()`` says which). A wheel that carries the library is tagged for the
platform it was built on (``py3-none-linux_x86_64``: any Python 3, since ctypes loads it, but
only that machine kind); one without it stays ``py3-none-any``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup

try:  # setuptools >= 70.1 has its own; before, the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "losshead"
OUT = PACKAGE / "_proto"
CONTRACT = "losshead/v1/losshead.proto"
HEALTH = "grpc/health/v1/health.proto"
NATIVE = "liblosshead_capi.so"


def _proto_root() -> Path:
    return Path(os.environ.get("LOSSHEAD_PROTO_DIR", HERE.parent.parent / "proto")).resolve()


def _protoc_command(root: Path) -> list[str]:
    includes = [f"-I{root}", f"-I{HERE / 'proto'}"]
    protoc = os.environ.get("PROTOC") or shutil.which("protoc")
    plugin = os.environ.get("GRPC_PYTHON_PLUGIN") or shutil.which("grpc_python_plugin")
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc={plugin}", *includes,
                f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_out={OUT}"]
    if importlib.util.find_spec("grpc_tools") is None:
        raise SystemExit(
            "losshead: cannot generate stubs: need protoc + grpc_python_plugin "
            "(Debian: protobuf-compiler protobuf-compiler-grpc) or the grpcio-tools package")
    return [sys.executable, "-m", "grpc_tools.protoc", *includes,
            f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}"]


def generate_stubs() -> None:
    root = _proto_root()
    if not (root / CONTRACT).is_file():
        if (OUT / "losshead" / "v1" / "losshead_pb2.py").is_file():
            return  # pre-generated (sdist / wheel rebuild)
        raise SystemExit(f"losshead: proto tree not found at {root}; set LOSSHEAD_PROTO_DIR")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    subprocess.run(_protoc_command(root) + [str(root / CONTRACT), str(HERE / "proto" / HEALTH)],
                   check=True)
    # protoc writes absolute imports (`from losshead.v1 import losshead_pb2`) that would resolve
    # against this very package (or grpc's); make them relative so the stubs live under
    # losshead._proto.
    for path in OUT.rglob("*_pb2_grpc.py"):
        text = path.read_text()
        text = re.sub(r"^from (losshead\.v1|grpc\.health\.v1) import ", "from . import ", text,
                      flags=re.M)
        path.write_text(text)
    for directory in [OUT, *[d for d in OUT.rglob("*") if d.is_dir()]]:
        (directory / "__init__.py").touch()


def copy_native_library() -> None:
    given = os.environ.get("LOSSHEAD_CAPI_LIB")
    source = Path(given) if given else HERE.parent.parent / "build" / "client" / "capi" / NATIVE
    target = PACKAGE / NATIVE
    if source.is_file():
        shutil.copy2(source, target)
    elif given:
        raise SystemExit(f"losshead: LOSSHEAD_CAPI_LIB={given} does not exist")
    elif target.exists():
        target.unlink()  # a stale copy from an earlier build must not outlive its source


class _Distribution(Distribution):
    """A distribution that carries the native library is a platform one: its files go to the
    wheel's root (platlib), not under .data/purelib."""

    def has_ext_modules(self) -> bool:
        return (PACKAGE / NATIVE).is_file()


class bdist_wheel(_bdist_wheel):  # noqa: N801 (the command's name)
    """Tags a wheel that carries the native library for its platform, not as pure Python."""

    def get_tag(self) -> tuple:
        python, abi, platform = super().get_tag()
        if self.root_is_pure:
            return python, abi, platform
        # The library has no Python ABI (ctypes): any Python 3 on this platform.
        return "py3", "none", platform


# Every setup.py invocation (metadata, wheel, editable) regenerates first: setuptools lists the
# package directories while preparing metadata, before any build command could run, and protoc
# takes milliseconds.
generate_stubs()
copy_native_library()
setup(distclass=_Distribution, cmdclass={"bdist_wheel": bdist_wheel},
      packages=["losshead", "losshead.integrations", "losshead._proto",
                "losshead._proto.losshead", "losshead._proto.losshead.v1", "losshead._proto.grpc",
                "losshead._proto.grpc.health", "losshead._proto.grpc.health.v1"])
