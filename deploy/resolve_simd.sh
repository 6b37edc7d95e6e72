#!/bin/sh
# Resolve the engine's SIMD mode for an image build.
#
#   resolve_simd.sh MODE [ARCH]     prints the mode to build with
#
# MODE: auto | scalar | native | avx2 | avx512 | neon-a76 (see engine_c/Makefile)
# ARCH: `uname -m` of the build container (default: this machine's)
#   auto   -> neon-a76 on aarch64 (-mcpu=cortex-a76.cortex-a55, the RK3588),
#             native on x86_64, scalar elsewhere
#   native on aarch64 is refused (exit 2): in an emulated arm64 build the
#             build machine is not the board
#   x86 modes on aarch64 and neon-a76 on x86_64 are refused (exit 2)
# Exit status 2 with a message on stderr for an unknown or refused mode.
set -eu
mode="${1:-auto}"
arch="${2:-$(uname -m)}"
case "$arch" in
    arm64) arch=aarch64 ;;
    amd64) arch=x86_64 ;;
esac
if [ "$mode" = auto ]; then
    case "$arch" in
        aarch64) mode=neon-a76 ;;
        x86_64) mode=native ;;
        *) mode=scalar ;;
    esac
fi
case "$arch:$mode" in
    *:scalar|aarch64:neon-a76|x86_64:native|x86_64:avx2|x86_64:avx512) ;;
    aarch64:native)
        echo "ECHOSPEC_SIMD=native is refused on aarch64: use neon-a76 or scalar" >&2; exit 2 ;;
    *)
        echo "ECHOSPEC_SIMD=$mode is not valid on $arch (auto, scalar, native, avx2, avx512, neon-a76)" >&2; exit 2 ;;
esac
echo "$mode"
