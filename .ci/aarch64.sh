#!/usr/bin/env bash
# Cross-compile engine_c for aarch64 and run every C test under user-mode
# emulation as a Cortex-A76 (the RK3588's big core).
#
#   .ci/aarch64.sh            both builds; quiet on success; one summary line
#   .ci/aarch64.sh -v         also print every test's output
#
# Builds (engine_c/build/aarch64-*, via engine_c/Makefile):
#   neon-a76  CC=aarch64-linux-gnu-gcc SIMD=neon-a76 (-mcpu=cortex-a76.cortex-a55:
#             armv8.2-a + dotprod + fp16, the NEON kernels)
#   scalar    CC=aarch64-linux-gnu-gcc SIMD=scalar (portable reference path)
# Runner: qemu-aarch64-static -cpu cortex-a76 -L /usr/aarch64-linux-gnu, so an
# instruction the A76 lacks traps here as it would on the board.
# Installs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user-static
# with apt-get when they are missing (root, as in CI).
# Each test binary prints "N passed, M failed"; the summary adds them up.
# test_neon_parity in the NEON build is also checked against the logits of the
# scalar build of the same tree (ES_PARITY_SCALAR), so it proves NEON == scalar
# bitwise even before tests/data/neon_parity_expected.txt is re-recorded.
# Exit status: 0 when both builds compiled and every test passed.
set -euo pipefail
cd "$(dirname "$0")/.."
VERBOSE=0
[ "${1:-}" = "-v" ] && VERBOSE=1

CC=aarch64-linux-gnu-gcc
QEMU=qemu-aarch64-static
SYSROOT=/usr/aarch64-linux-gnu
need=()
command -v "$CC" >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu)
[ -f "$SYSROOT/include/stdio.h" ] || need+=(libc6-dev-arm64-cross)
command -v "$QEMU" >/dev/null 2>&1 || need+=(qemu-user-static)
if [ ${#need[@]} -gt 0 ]; then
    echo "aarch64: installing ${need[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    if ! out=$( { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } 2>&1); then
        echo "$out" | tail -20 >&2
        echo "aarch64: could not install ${need[*]}" >&2
        exit 1
    fi
fi
RUNNER="$QEMU -cpu cortex-a76 -L $SYSROOT"
# A test binary that runs past this many seconds under emulation is stopped
# and counted as failing (exit 124), so a hang cannot eat CI's time budget.
TEST_TIMEOUT=${ES_AARCH64_TEST_TIMEOUT:-900}

passed=0
failed=0
broken=()
tests=$(cd engine_c && ls tests/test_*.c | sed 's#^tests/\(.*\)\.c$#\1#')
built=()
for simd in neon-a76 scalar; do
    build="build/aarch64-$simd"
    targets=()
    for t in $tests; do targets+=("$build/tests/$t"); done
    if ! out=$(make -s -C engine_c -j"$(nproc)" BUILD="$build" CC="$CC" SIMD="$simd" \
               "$build/libechospec_engine.a" "${targets[@]}" 2>&1); then
        echo "$out" | tail -40 >&2
        echo "aarch64: the $simd build failed" >&2
        broken+=("$simd:build")
        continue
    fi
    if ! file "engine_c/$build/tests/$(echo "$tests" | head -1)" | grep -q "ARM aarch64"; then
        echo "aarch64: engine_c/$build does not hold aarch64 binaries" >&2
        broken+=("$simd:arch")
        continue
    fi
    built+=("$simd")
done

# The scalar build's parity results of this very tree: test_neon_parity in the
# NEON build must reproduce its logits bitwise (ES_PARITY_SCALAR).
scalar_rec="$PWD/engine_c/build/aarch64-scalar/neon_parity_scalar.txt"
rm -f "$scalar_rec"
if [[ " ${built[*]} " == *" scalar "* ]] && [ -f engine_c/tests/test_neon_parity.c ]; then
    if ! out=$(cd engine_c && ES_PARITY_RECORD="$scalar_rec" $RUNNER build/aarch64-scalar/tests/test_neon_parity 2>&1); then
        echo "$out" | tail -20 >&2
        echo "aarch64: recording the scalar build's parity results failed" >&2
        broken+=("scalar:parity-record")
        rm -f "$scalar_rec"
    fi
fi

for simd in "${built[@]}"; do
    build="build/aarch64-$simd"
    for t in $tests; do
        rc=0
        out=$(cd engine_c && ES_EXPECT_SIMD="$simd" ES_PARITY_SCALAR="$([ -f "$scalar_rec" ] && echo "$scalar_rec")" \
              timeout "$TEST_TIMEOUT" $RUNNER "$build/tests/$t" 2>&1) || rc=$?
        if [ "$rc" -eq 124 ]; then
            # Stopped at the time limit: run it once more, so that a stall of
            # the emulator is told apart from a hang of the code (which stops
            # again and fails). Both runs are reported.
            echo "aarch64: $simd $t ran past ${TEST_TIMEOUT}s and was stopped; running it once more" >&2
            rc=0
            out=$(cd engine_c && ES_EXPECT_SIMD="$simd" ES_PARITY_SCALAR="$([ -f "$scalar_rec" ] && echo "$scalar_rec")" \
                  timeout "$TEST_TIMEOUT" $RUNNER "$build/tests/$t" 2>&1) || rc=$?
            [ "$rc" -eq 0 ] && echo "aarch64: $simd $t passed on its second run" >&2
        fi
        line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -1 || true)
        if [ -n "$line" ]; then
            p=${line%% passed*}
            f=${line#*passed, }
            f=${f%% failed}
            passed=$((passed + p))
            failed=$((failed + f))
        fi
        if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
            [ -n "$line" ] || failed=$((failed + 1))
            broken+=("$simd:$t")
            [ "$rc" -eq 124 ] && echo "aarch64: $simd $t ran past ${TEST_TIMEOUT}s and was stopped" >&2
            echo "== aarch64 $simd $t (exit $rc)" >&2
            echo "$out" | grep -v '^ok ' | tail -40 >&2
        elif [ "$VERBOSE" -eq 1 ]; then
            echo "== aarch64 $simd $t"
            echo "$out"
        fi
    done
done
# tools/perf/a76_estimate.py (the A76 estimate, bench/README.md) finds its loops in this
# tree's NEON assembly: a kernel rewrite that hides them fails here, not at the
# next estimate.
if [ -f tools/perf/a76_estimate.py ] && ! out=$(python3 tools/perf/a76_estimate.py --check 2>&1); then
    echo "$out" | tail -5 >&2
    broken+=("a76_estimate:loops")
fi
echo "aarch64: $passed passed, $failed failed (C tests under $RUNNER; builds neon-a76 + scalar)${broken:+; failing: ${broken[*]}}"
[ ${#broken[@]} -eq 0 ]
