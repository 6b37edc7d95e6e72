#!/usr/bin/env bash
# deploy/docker-compose.yml up for real, on a Debian host without Docker Engine or Docker Hub:
# podman (Debian's package) serves the Docker API on a socket, and the Compose CLI of
# .ci/deploy_check.sh --tools drives it. Run as root, from any directory:
#
#   .ci/compose_up.sh
#
# Phases, each with its elapsed time:
#   tools    Debian packages (podman, runc, netavark, debootstrap, ...; apt-get only when one
#            is missing), the Compose CLI, the project venv (.venv, scripts/setup.sh)
#   podman   a containers.conf of our own (CONTAINERS_CONF: runtime runc, nofile and nproc
#            4096; the system's /etc/containers is not touched) and `podman system service`
#            on build/compose-up/podman.sock (DOCKER_HOST)
#   base     stand-ins for python:3.11-slim-bookworm and python:3.11-bookworm, the base images
#            deploy/Dockerfile names: debootstrap --variant=minbase bookworm + Debian's
#            python3.11, pip and venv (+ gcc, make, python3-dev for the builder's), the host's
#            CA bundle and pip index settings baked in, `python` and `pip` on PATH. Kept in
#            podman's storage and reused while the host's CA bundle, its pip index and the
#            recipe below are the same
#   build    every image of the compose file: podman build --network host per Dockerfile target
#            (the builder stage needs PyPI), with deploy/Dockerfile.dockerignore; the builder
#            stage is tagged echospec-builder, so an unchanged tree builds from the cache
#   up       docker-compose up -d with deploy/compose.fleet.yml (two verifiers), a fresh
#            ECHOSPEC_INTERNAL_KEY, cpusets 0-1, and its own project name and host ports
#   healthy  every healthcheck turns healthy (podman runs healthchecks from systemd timers;
#            without systemd this script runs them, `podman healthcheck run`, every 3 s)
#   checks   a chat completion through the gateway (HTTP), a generation through the
#            coordinator's gRPC port (`echospec generate`), and a verifier killed mid-stream:
#            the generation moves to the other verifier and its text equals an untouched run
#   down     docker-compose down -v leaves no container, network or volume of the project
#            (the images stay in podman's storage, for the next run)
# On exit, failed or not, everything of the project is removed and the podman service stopped;
# a failure prints the logs of the stack's containers.
#
# Environment: COMPOSE_UP_PORT_BASE (default 55000): the published ports are BASE+51 (gRPC),
# BASE+80 (HTTP) and BASE+101..104 (/metrics), all on 127.0.0.1.
# DEBIAN_MIRROR (default: the host's own apt source for bookworm main): debootstrap's mirror.
# Exit status: 0 when every check passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=$ROOT/build/compose-up
PROJECT=echospec-ci
BASE_PORT=${COMPOSE_UP_PORT_BASE:-55000}
. "$ROOT/deploy/debian_mirror.sh"
MIRROR=$(debian_mirror)
SLIM=python:3.11-slim-bookworm
FULL=python:3.11-bookworm
TARGETS=(draft verifier coordinator gateway)
mkdir -p "$WORK"

T0=$SECONDS
PHASE=""
PHASE_T0=$SECONDS
TIMES=()
SERVICE_PID=""
HEALTH_PID=""
STACK_UP=0
note() { echo "compose-up: $*"; }
phase() {
    [ -n "$PHASE" ] && TIMES+=("$PHASE $((SECONDS - PHASE_T0))s")
    PHASE=$1; PHASE_T0=$SECONDS
    note "== $1 ($((SECONDS - T0)) s)"
}
pass() { echo "PASS $* ($((SECONDS - T0)) s)"; }
fail() { echo "FAIL $* ($((SECONDS - T0)) s)" >&2; exit 1; }
# run a command quietly; on failure show its output and fail with the message
quiet() {
    local what=$1; shift
    local out
    if ! out=$("$@" 2>&1); then
        echo "$out" | tail -n 40 >&2
        fail "$what"
    fi
}

[ "$(id -u)" = 0 ] || { echo "compose-up: run as root (podman, debootstrap)" >&2; exit 1; }

# ---- tools -----------------------------------------------------------------------------
phase tools
PKGS=(podman runc conmon catatonit netavark aardvark-dns iptables debootstrap)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    note "apt-get install ${missing[*]}"
    quiet "apt-get update" apt-get update -qq
    quiet "apt-get install ${missing[*]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    note "Debian packages present: ${PKGS[*]}"
fi
TOOLS=$(.ci/deploy_check.sh --tools | tail -n 1)
COMPOSE_BIN=$TOOLS/docker-compose
if ! .venv/bin/python -c "import echospec_client" 2>/dev/null; then
    note "making the project venv (scripts/setup.sh)"
    quiet "scripts/setup.sh" scripts/setup.sh
fi
note "podman $(podman --version | awk '{print $NF}'), docker-compose $("$COMPOSE_BIN" version --short)"

# ---- podman service --------------------------------------------------------------------
phase podman
export CONTAINERS_CONF=$WORK/containers.conf
cat > "$CONTAINERS_CONF" <<'EOF'
# written by .ci/compose_up.sh
[containers]
# podman's defaults exceed the hard limits of some hosts
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]

[engine]
# crun refuses some hosts' cgroup v1 layouts; runc runs there
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
EOF
SOCK=$WORK/podman.sock
export DOCKER_HOST=unix://$SOCK
cleanup() {
    local status=$?
    set +e
    [ -n "$HEALTH_PID" ] && kill "$HEALTH_PID" 2>/dev/null && wait "$HEALTH_PID" 2>/dev/null
    if [ "$STACK_UP" = 1 ]; then
        if [ "$status" != 0 ]; then
            for c in $(podman ps -a --format '{{.Names}}' --filter "label=com.docker.compose.project=$PROJECT"); do
                echo "---- logs of $c ($(podman inspect --format '{{.State.Status}} {{.State.Health.Status}}' "$c" 2>/dev/null))" >&2
                podman logs --tail 40 "$c" 2>&1 | sed 's/^/    /' >&2
            done
        fi
        note "tearing down"
        compose down -v --remove-orphans -t 5 >/dev/null 2>&1
        podman rm -f $(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT") >/dev/null 2>&1
        podman volume rm -f $(podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT") >/dev/null 2>&1
        podman network rm -f $(podman network ls -q --filter "label=com.docker.compose.project=$PROJECT") >/dev/null 2>&1
    fi
    [ -n "$SERVICE_PID" ] && kill "$SERVICE_PID" 2>/dev/null && wait "$SERVICE_PID" 2>/dev/null
    rm -f "$SOCK"
    [ "$status" != 0 ] && echo "compose-up: FAILED in phase $PHASE after $((SECONDS - T0)) s (before it: ${TIMES[*]:-none})" >&2
    exit "$status"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
rm -f "$SOCK"
podman system service --time=0 "unix://$SOCK" > "$WORK/podman-service.log" 2>&1 &
SERVICE_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || { cat "$WORK/podman-service.log" >&2; fail "podman system service did not open $SOCK"; }
docker version --format 'docker API {{.Server.APIVersion}} ({{.Server.Os}})' >/dev/null 2>&1 \
    || fail "the Docker CLI cannot talk to podman's socket"
note "podman service on $SOCK (pid $SERVICE_PID)"

# ---- stand-in base images ---------------------------------------------------------------
phase base
# pip settings of the host that reach a package index: its index URL (a mirror), if any
PIP_INDEX=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || true)}
CA=/etc/ssl/certs/ca-certificates.crt
[ -r "$CA" ] || fail "no CA bundle at $CA"
STAMP=$( (cat "$CA"; echo "$PIP_INDEX"; sed -n '/^    # base_recipe_start/,/^    # base_recipe_end/p' "$0") | sha256sum | cut -c1-16)
have_base() {
    local img=$1 label
    podman image exists "$img" || return 1
    label=$(podman image inspect --format '{{index .Labels "echospec.base-stamp"}}' "$img" 2>/dev/null)
    # a real python image (pulled or loaded by the user) is used as it is
    [ -z "$label" ] || [ "$label" = "$STAMP" ] || [ "$label" = "<no value>" ]
}
if have_base "$SLIM" && have_base "$FULL"; then
    note "reusing $SLIM and $FULL from podman's storage"
else
    # base_recipe_start (its text is part of the cache stamp)
    rootfs=$WORK/rootfs
    rm -rf --one-file-system "$rootfs"
    mkdir -p "$WORK/debs"
    [ -n "$MIRROR" ] || fail "no apt source for bookworm main on this host: set DEBIAN_MIRROR"
    note "debootstrap --variant=minbase bookworm (python3, pip, venv) from $MIRROR"
    quiet "debootstrap" debootstrap --variant=minbase --cache-dir="$WORK/debs" \
        --include=python3,python3-pip,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR"
    # the host's CA bundle (TLS to the package index may pass only through its CAs) and its
    # index settings; the official images' pip may install system-wide, as root
    cp "$CA" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    { echo "[global]"; echo "cert = $CA"; [ -n "$PIP_INDEX" ] && echo "index-url = $PIP_INDEX"; } \
        > "$rootfs/etc/pip.conf"
    rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    note "importing $SLIM"
    changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
             --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]'
             --change "LABEL echospec.base-stamp=$STAMP")
    tar -C "$rootfs" -c . | quiet "podman import $SLIM" podman import "${changes[@]}" - "$SLIM"
    rm -rf --one-file-system "$rootfs"
    note "building $FULL (gcc, make, python3-dev)"
    printf 'FROM %s\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc make libc6-dev python3-dev >/dev/null && rm -rf /var/lib/apt/lists/*\n' \
        "$SLIM" > "$WORK/Containerfile.full"
    quiet "podman build $FULL" podman build --network host -t "$FULL" -f "$WORK/Containerfile.full" "$WORK"
    # base_recipe_end
fi
pass "stand-in base images $SLIM, $FULL"

# ---- build ----------------------------------------------------------------------------
phase build
# The builder stage gets a tag too, so the next run finds it in the cache; each run removes
# the images its build replaced (no other image is touched).
for t in builder "${TARGETS[@]}"; do
    old=$(podman image inspect --format '{{.Id}}' "echospec-$t:latest" 2>/dev/null || true)
    note "podman build --target $t"
    quiet "podman build --target $t" podman build --network host --target "$t" \
        --ignorefile deploy/Dockerfile.dockerignore -f deploy/Dockerfile -t "echospec-$t:latest" .
    new=$(podman image inspect --format '{{.Id}}' "echospec-$t:latest")
    if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
done
pass "images built: ${TARGETS[*]/#/echospec-}"

# ---- up ---------------------------------------------------------------------------------
phase up
INTERNAL_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
COMPOSE_ENV=(PATH="$PATH" HOME="${HOME:-/tmp}" DOCKER_HOST="$DOCKER_HOST"
    ECHOSPEC_INTERNAL_KEY="$INTERNAL_KEY"
    ECHOSPEC_VERIFIER_CPUSET=0-1 ECHOSPEC_DRAFT_CPUSET=0-1 ECHOSPEC_COORDINATOR_CPUSET=0-1
    ECHOSPEC_N_THREADS=1
    ECHOSPEC_PUBLISH_PORT=$((BASE_PORT + 51)) ECHOSPEC_HTTP_PUBLISH_PORT=$((BASE_PORT + 80))
    ECHOSPEC_COORDINATOR_METRICS_PORT=$((BASE_PORT + 101))
    ECHOSPEC_DRAFT_METRICS_PORT=$((BASE_PORT + 102))
    ECHOSPEC_VERIFIER_METRICS_PORT=$((BASE_PORT + 103))
    ECHOSPEC_VERIFIER2_METRICS_PORT=$((BASE_PORT + 104)))
# the Compose CLI on the two files, with only the variables above (deploy/.env is not read)
compose() {
    (cd deploy && env -i "${COMPOSE_ENV[@]}" timeout "${COMPOSE_TIMEOUT:-300}" "$COMPOSE_BIN" \
        -p "$PROJECT" -f docker-compose.yml -f compose.fleet.yml --env-file /dev/null "$@")
}
in_project() { podman "$1" ls -q --filter "label=com.docker.compose.project=$PROJECT"; }
[ -z "$(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT")$(in_project volume)$(in_project network)" ] \
    || fail "leftovers of project $PROJECT from an earlier run: remove them first (podman ps -a, volume ls, network ls)"
# the compose file's default host directories for user models and certificates
mkdir -p deploy/models deploy/certs
STACK_UP=1
# podman runs healthchecks from systemd timers; without systemd, run them here
if ! pidof systemd >/dev/null 2>&1; then
    (while sleep 3; do
        for c in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT"); do
            podman healthcheck run "$c" >/dev/null 2>&1 || true
        done
    done) &
    HEALTH_PID=$!
    note "no systemd: this script runs the containers' healthchecks every 3 s"
fi
note "docker-compose up -d: model-init, draft, verifier, verifier2, coordinator, gateway (cpusets 0-1)"
if ! COMPOSE_TIMEOUT=600 compose up -d 2>&1 | sed 's/^/    /'; then
    fail "docker-compose up -d"
fi
pass "docker-compose up -d"

# ---- healthy --------------------------------------------------------------------------
phase healthy
SERVICES=(draft verifier verifier2 coordinator gateway)
deadline=$((SECONDS + 300))
while :; do
    states=()
    all=1
    for s in "${SERVICES[@]}"; do
        st=$(podman inspect --format '{{.State.Health.Status}}' "$PROJECT-$s-1" 2>/dev/null || echo missing)
        states+=("$s=$st")
        [ "$st" = healthy ] || all=0
    done
    [ "$all" = 1 ] && break
    [ $SECONDS -lt $deadline ] || fail "healthchecks not all healthy within 300 s: ${states[*]}"
    note "waiting: ${states[*]}"
    sleep 5
done
init_exit=$(podman inspect --format '{{.State.ExitCode}}' "$PROJECT-model-init-1")
[ "$init_exit" = 0 ] || fail "model-init exited with status $init_exit"
pass "model-init exited 0; healthy: ${SERVICES[*]}"

# ---- checks ---------------------------------------------------------------------------
phase checks
GRPC=127.0.0.1:$((BASE_PORT + 51))
out=$(.venv/bin/python .ci/compose_up_checks.py http "127.0.0.1:$((BASE_PORT + 80))" 2>&1) \
    || { echo "$out" >&2; fail "generation through the gateway (HTTP)"; }
pass "generation through the gateway (HTTP): $out"
out=$(.venv/bin/echospec generate --target "$GRPC" --json --max-tokens 24 --spec on \
      "1, 2, 3, 4, 5, 6, 7, 8," 2>&1) || { echo "$out" >&2; fail "generation through gRPC"; }
summary=$(echo "$out" | .venv/bin/python -c '
import json, sys
r = json.load(sys.stdin)
assert r["completion_tokens"] > 0 and r["finish_reason"] == "length", r
print("%d tokens on %s, spec tries %d hits %d: %r" % (r["completion_tokens"], r["verifier"],
      r["stats"]["tries"], r["stats"]["hits"], r["text"]))') \
    || { echo "$out" >&2; fail "generation through gRPC"; }
pass "generation through gRPC (echospec generate): $summary"
out=$(.venv/bin/python .ci/compose_up_checks.py move "$GRPC" \
      "verifier=127.0.0.1:$((BASE_PORT + 103))" "verifier2=127.0.0.1:$((BASE_PORT + 104))" \
      --container-prefix "$PROJECT-" --kill podman kill 2>&1) \
    || { echo "$out" >&2; fail "verifier killed mid-stream"; }
pass "verifier killed mid-stream: $(echo "$out" | tr '\n' ' ')"

# ---- down -----------------------------------------------------------------------------
phase down
compose down -v --remove-orphans -t 10 >/dev/null 2>&1 || fail "docker-compose down -v"
left="$(podman ps -a --format '{{.Names}}' --filter "label=com.docker.compose.project=$PROJECT") $(in_project volume) $(in_project network)"
left=$(echo $left)
[ -z "$left" ] || fail "left behind after docker-compose down -v: $left"
[ -z "$(podman ps -a --format '{{.Names}}' | grep -E "^$PROJECT-" || true)" ] \
    || fail "containers named $PROJECT-* left behind"
[ -z "$(podman network ls --format '{{.Name}}' | grep -E "^$PROJECT" || true)" ] \
    || fail "networks named $PROJECT* left behind"
[ -z "$(podman volume ls --format '{{.Name}}' | grep -E "^$PROJECT" || true)" ] \
    || fail "volumes named $PROJECT* left behind"
STACK_UP=0
pass "docker-compose down -v: no container, network or volume of $PROJECT left (images kept: $(podman images --format '{{.Repository}}' | grep -c -E 'echospec-|python') cached)"

phase done
note "times: ${TIMES[*]}; total $((SECONDS - T0)) s"
echo "compose-up: ok"
