#!/usr/bin/env bash
# Idempotent setup for a fresh machine: a venv in .venv, the package built
# (C engine via cffi, gRPC stubs from protos/), the default model fetched.
#   ECHOSPEC_SIMD=scalar scripts/setup.sh   builds the portable engine
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "echospec setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.echospec-build-stamp
src_hash=$( (cat pyproject.toml setup.py engine_c/build_ffi.py; find engine_c/src engine_c/include protos -type f | sort | xargs cat; cat clients/python/setup.py clients/python/pyproject.toml; echo "${ECHOSPEC_SIMD:-auto}") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$src_hash" ] || ! .venv/bin/python -c "import echospec._engine, echospec.v1, echospec_client.v1.coordinator_pb2_grpc" 2>/dev/null; then
  echo "echospec setup: installing dependencies and building the engine (a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel cffi "grpcio-tools<1.86"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test]"
  echo "$src_hash" > "$stamp"
fi
.venv/bin/python scripts/fetch_model.py > /dev/null
