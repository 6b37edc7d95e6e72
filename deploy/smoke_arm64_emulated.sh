#!/usr/bin/env bash
# deploy/smoke_nodocker.sh on arm64 without a board: a Debian bookworm arm64
# root (debootstrap) run through qemu-user as a Cortex-A76 (binfmt_misc).
# This is the closest this x86-64 machine gets to the arm64 image: the same
# Debian release and Python 3.11 as python:3.11-slim-bookworm, the builder's
# pip wheel (engine compiled with neon-a76 flags chosen by resolve_simd.sh
# from `uname -m` = aarch64), the runtime's offline install, model-init, the
# three services, health, one speculative generate and SIGTERM.
#
#   sudo deploy/smoke_arm64_emulated.sh      about 15 minutes on 2 cores
#
# Needs root (debootstrap, chroot, mounts, binfmt_misc), Debian's debootstrap
# and qemu-user-static (installed with apt-get when missing), and access to
# the Debian archive (DEBIAN_MIRROR, else the host's apt source:
# deploy/debian_mirror.sh) and PyPI. The default model is bind-mounted
# read-only from the host cache (scripts/fetch_model.py; ECHOSPEC_CACHE), so
# it is not downloaded again. Everything it mounts or registers is undone on exit; the
# root file system is kept in $ARM_ROOT (default /tmp/echospec-arm64-root)
# for a faster second run.
# Exit status 0 when the smoke test passed inside the arm64 root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
R=${ARM_ROOT:-/tmp/echospec-arm64-root}
CACHE=${ECHOSPEC_CACHE:-$HOME/.cache/echospec}
BINFMT=/proc/sys/fs/binfmt_misc
[ "$(id -u)" -eq 0 ] || { echo "smoke-arm64: needs root" >&2; exit 1; }
[ -f "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf" ] || { echo "smoke-arm64: run scripts/fetch_model.py first" >&2; exit 1; }
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

mounted_binfmt=0
registered=0
cleanup() {
    for m in "$R/root/.cache/echospec" "$R/dev" "$R/proc"; do
        mountpoint -q "$m" 2>/dev/null && umount "$m"
    done
    [ "$registered" -eq 1 ] && echo -1 > "$BINFMT/qemu-aarch64"
    [ "$mounted_binfmt" -eq 1 ] && umount "$BINFMT"
    return 0
}
trap cleanup EXIT

if [ ! -f "$BINFMT/register" ]; then
    mount -t binfmt_misc binfmt_misc "$BINFMT"
    mounted_binfmt=1
fi
if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
        > "$BINFMT/register"
    registered=1
fi

if [ ! -x "$R/usr/bin/python3" ]; then
    . "$ROOT/deploy/debian_mirror.sh"
    MIRROR=$(debian_mirror)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
    echo "smoke-arm64: debootstrap bookworm arm64 from $MIRROR into $R (about 10 minutes)" >&2
    rm -rf "$R"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-dev,gcc,libc6-dev,make,ca-certificates \
        bookworm "$R" "$MIRROR" > /tmp/echospec-debootstrap.log 2>&1 \
        || { tail -20 /tmp/echospec-debootstrap.log >&2; exit 1; }
fi
cp /etc/resolv.conf "$R/etc/resolv.conf"
# the host's CA bundle, so pip inside trusts what pip outside trusts
cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/ca-certificates.crt"
rm -rf "$R/src" && mkdir -p "$R/src" "$R/root/.cache/echospec"
(cd "$ROOT" && tar -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./engine_c/build \
    --exclude='__pycache__' --exclude='*.so' --exclude='*.o' --exclude='*.egg-info' .) | tar -x -C "$R/src"
mount -t proc proc "$R/proc"
mount --bind /dev "$R/dev"
mount --bind "$CACHE" "$R/root/.cache/echospec"
mount -o remount,bind,ro "$R/root/.cache/echospec"

chroot "$R" /usr/bin/env -i QEMU_CPU=cortex-a76 HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin TMPDIR=/tmp \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    ECHOSPEC_SMOKE_PORT="${ECHOSPEC_SMOKE_PORT:-52051}" \
    bash /src/deploy/smoke_nodocker.sh 2>&1 | sed 's/^smoke:/smoke (arm64, qemu cortex-a76):/'
exit "${PIPESTATUS[0]}"
