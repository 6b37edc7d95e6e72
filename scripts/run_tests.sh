#!/usr/bin/env bash
# The test suite: C engine tests (native, scalar, and under ASan+UBSan), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== engine_c: native" >&2
make -s -C engine_c BUILD=build/native test
echo "== engine_c: scalar" >&2
make -s -C engine_c BUILD=build/scalar SIMD=scalar test
echo "== engine_c: ASan + UBSan" >&2
make -s -C engine_c BUILD=build/san SAN=1 test
echo "== pytest" >&2
exec .venv/bin/python -m pytest -q "$@"
