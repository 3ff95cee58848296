#!/usr/bin/env bash
# Installs the losshead Python package into a virtual environment that sees the system's torch,
# grpcio, protobuf and pytest (no network needed), then runs its tests. The tests start a
# CPU-backend losshead-server: $LOSSHEAD_SERVER_BIN, else build/server/losshead-server. The
# package carries the native library (liblosshead_capi.so) of the same build: $LOSSHEAD_CAPI_LIB,
# else client/capi/liblosshead_capi.so beside the server's build; the tests then demand it.
#
#   client/python/run_tests.sh [pytest args...]
#
# Environment: PYTHON (interpreter for the venv; default /usr/bin/python3), LOSSHEAD_PY_VENV
# (default build-py/venv under the repository root), LOSSHEAD_SERVER_BIN, LOSSHEAD_CAPI_LIB,
# LOSSHEAD_SERVER_BACKEND (the test servers' backend: cpu, or cuda on a GPU host; default cpu).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-/usr/bin/python3}
[ -x "$python" ] || python=python3
venv=${LOSSHEAD_PY_VENV:-$repo/build-py/venv}
server=${LOSSHEAD_SERVER_BIN:-$repo/build/server/losshead-server}
capi=${LOSSHEAD_CAPI_LIB:-$(dirname "$(dirname "$server")")/client/capi/liblosshead_capi.so}
if [ -f "$capi" ]; then
  # setup.py copies it into the package; the tests fail rather than fall back without it.
  export LOSSHEAD_CAPI_LIB=$capi LOSSHEAD_TEST_NATIVE=1
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv --system-site-packages "$venv"
fi
# --no-build-isolation: build with the system's setuptools; setup.py generates the stubs from
# proto/ with protoc + grpc_python_plugin. --no-deps --no-index: everything else is installed.
"$venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps --no-index \
  --force-reinstall "$here"
cd "$here"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
