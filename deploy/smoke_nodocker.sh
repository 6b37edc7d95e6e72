#!/usr/bin/env bash
# The images' build and run steps without Docker, on this machine:
#   1. builder stage:  pip wheel of the repository (engine compiled with the
#      ECHOSPEC_SIMD that deploy/resolve_simd.sh picks) and of every dependency
#   2. runtime stage:  a fresh venv, pip install --no-index from those wheels
#   3. model-init:     deploy/model_init.py (the default model from the cache,
#                      or ECHOSPEC_MODEL_FILE from ECHOSPEC_IMPORT_DIR)
#   4. the three services started as the compose file starts them (same
#      ECHOSPEC_* variables, loopback instead of 0.0.0.0), run from outside the
#      source tree so only the installed wheel is used
#   5. deploy/healthcheck.py until all three are SERVING, one greedy generate
#      with speculation on through the coordinator, then SIGTERM and a check
#      that each service stops within its grace period
#
#   deploy/smoke_nodocker.sh            ports 51051-51053 (ECHOSPEC_SMOKE_PORT=P: P..P+2)
# Needs python3 (3.10+) with venv, a C compiler and PyPI access (step 1).
# Exit status 0 with one summary line when everything passed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${ECHOSPEC_SMOKE_PORT:-51051}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "smoke: $*" >&2; for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "== $f" >&2; tail -20 "$f" >&2; }; done; exit 1; }

# 1. builder: a copy of the build context without host build outputs
mkdir -p "$WORK/ctx" "$WORK/app/deploy" "$WORK/app/scripts"
(cd "$ROOT" && tar -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./engine_c/build \
    --exclude='__pycache__' --exclude='*.so' --exclude='*.o' --exclude='*.egg-info' --exclude=./.pytest_cache \
    --exclude=./echospec/_engine.c --exclude='./echospec/v1/*_pb2*.py' .) | tar -x -C "$WORK/ctx"
simd=$(sh "$ROOT/deploy/resolve_simd.sh" "${ECHOSPEC_SIMD:-auto}" "$(uname -m)")
"$PY" -m venv "$WORK/build-venv"
ECHOSPEC_SIMD="$simd" "$WORK/build-venv/bin/python" -m pip wheel -q --disable-pip-version-check \
    --wheel-dir "$WORK/wheels" "$WORK/ctx" > "$WORK/wheel.log" 2>&1 || fail "pip wheel failed"

# 2. runtime
"$PY" -m venv "$WORK/rt"
"$WORK/rt/bin/python" -m pip install -q --disable-pip-version-check --no-index \
    --find-links="$WORK/wheels" "$WORK"/wheels/*.whl > "$WORK/install.log" 2>&1 || fail "install from wheels failed"
cp "$ROOT/deploy/healthcheck.py" "$ROOT/deploy/model_init.py" "$WORK/app/deploy/"
cp "$ROOT/scripts/fetch_model.py" "$WORK/app/scripts/"
cd "$WORK/app"
P="$WORK/rt/bin/python"
engine_simd=$("$P" -c "import echospec._engine as e; print(e.ffi.string(e.lib.es_simd_name()).decode())")

# 3. model-init
model=$("$P" deploy/model_init.py 2> "$WORK/model-init.log") || fail "model-init failed"

# 4. services, with the compose file's variables
ECHOSPEC_HOST=127.0.0.1 ECHOSPEC_PORT=$((PORT + 1)) ECHOSPEC_MIN_N=2 \
    "$P" -m echospec.services.draft > "$WORK/draft.log" 2>&1 & pids+=($!)
ECHOSPEC_HOST=127.0.0.1 ECHOSPEC_PORT=$((PORT + 2)) ECHOSPEC_MODEL="$model" ECHOSPEC_N_THREADS=2 \
    ECHOSPEC_N_CTX=2048 ECHOSPEC_MAX_SESSIONS=8 ECHOSPEC_DRAFT_TARGET=127.0.0.1:$((PORT + 1)) \
    "$P" -m echospec.services.verifier > "$WORK/verifier.log" 2>&1 & pids+=($!)
ECHOSPEC_HOST=127.0.0.1 ECHOSPEC_PORT=$PORT ECHOSPEC_MODEL="$model" \
    ECHOSPEC_DRAFT_TARGET=127.0.0.1:$((PORT + 1)) ECHOSPEC_VERIFIER_TARGET=127.0.0.1:$((PORT + 2)) \
    ECHOSPEC_SPEC=off ECHOSPEC_K=16 ECHOSPEC_MAX_TOKENS=256 \
    "$P" -m echospec.services.coordinator > "$WORK/coordinator.log" 2>&1 & pids+=($!)

# 5. health, one call, graceful stop
serving=0
for _ in $(seq 1 120); do
    serving=1
    for p in $((PORT + 1)) $((PORT + 2)) $PORT; do
        "$P" deploy/healthcheck.py "127.0.0.1:$p" 2>/dev/null || serving=0
    done
    [ "$serving" -eq 1 ] && break
    sleep 1
done
[ "$serving" -eq 1 ] || fail "services not SERVING after 120 s"
out=$("$WORK/rt/bin/echospec" generate --target "127.0.0.1:$PORT" --json --spec on --k 4 --max-tokens 24 \
      "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,") || fail "generate failed"
summary=$(echo "$out" | "$P" -c "
import json, sys
d = json.load(sys.stdin)
s = d['stats']
assert d['spec_enabled'] and d['token_ids'], d
assert s['hits'] + s['kv_rolls'] == s['draft_tokens'], s
print(f\"{len(d['token_ids'])} tokens, tries {s['tries']}, hits {s['hits']}, kv_rolls {s['kv_rolls']}\")
") || fail "unexpected generate output: $out"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do
    for _ in $(seq 1 75); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$p" 2>/dev/null && fail "pid $p still running 15 s after SIGTERM"
done
pids=()
echo "smoke: ok (engine $engine_simd, wheels installed offline, 3 services SERVING, generate: $summary, SIGTERM stops within 15 s)"
