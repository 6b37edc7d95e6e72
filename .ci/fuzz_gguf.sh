#!/usr/bin/env bash
# Fuzz the C GGUF reader and model loading (engine_c/fuzz/fuzz_gguf.c) with
# libFuzzer + ASan + UBSan (Debian packages clang-14 and libclang-rt-14-dev).
#
#   .ci/fuzz_gguf.sh [SECONDS]     default 60: the bounded CI run
#
# 1. Build the harness, and a canary build that crashes on any valid
#    version-2 file; the canary must be caught within 60 s, which proves that
#    a crash fails this script.
# 2. Run the real harness for SECONDS, seeded with small valid GGUF files
#    (engine_c/fuzz/make_seeds.py). The corpus grows in build/fuzz/corpus and
#    is kept between runs.
# Exit status: 0 when the fuzzer found nothing; 1 when it found a crash, a
# leak or UB (the input is saved as build/fuzz/crash-*, reproduce with
# build/fuzz/fuzz_gguf build/fuzz/crash-...), or when the canary was missed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_RUN=${1:-60}
CC_FUZZ=${CC_FUZZ:-clang-14}
OUT=build/fuzz
PY=${PYTHON:-.venv/bin/python}

if ! command -v "$CC_FUZZ" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "fuzz_gguf: installing clang-14 and libclang-rt-14-dev (Debian packages)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 \
        libclang-rt-14-dev >/dev/null
fi
if ! command -v "$CC_FUZZ" >/dev/null; then
    echo "fuzz_gguf: $CC_FUZZ not found (apt-get install clang-14 libclang-rt-14-dev)" >&2
    exit 1
fi
mkdir -p "$OUT/seeds" "$OUT/corpus" "$OUT/canary-corpus"
# Scalar kernels: the target is the reader, and clang-14 cannot build every
# AVX-512 path the native GCC build uses.
CFLAGS=(-g -O1 -std=c11 -D_GNU_SOURCE -DES_FORCE_SCALAR -Iengine_c/include -Iengine_c/src -pthread
        -ffp-contract=off -Wno-psabi -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
SRCS=(engine_c/fuzz/fuzz_gguf.c engine_c/src/*.c)
"$CC_FUZZ" "${CFLAGS[@]}" "${SRCS[@]}" -lm -o "$OUT/fuzz_gguf"
"$CC_FUZZ" "${CFLAGS[@]}" -DES_FUZZ_CANARY "${SRCS[@]}" -lm -o "$OUT/fuzz_gguf_canary"
"$PY" engine_c/fuzz/make_seeds.py "$OUT/seeds"

# -close_fd_mask=1: the harness prints nothing, libFuzzer's own lines go to stderr
if "$OUT/fuzz_gguf_canary" -max_total_time=60 -artifact_prefix="$OUT/canary-" \
        "$OUT/canary-corpus" "$OUT/seeds" > "$OUT/canary.log" 2>&1; then
    echo "fuzz_gguf: the canary crash was not found in 60 s: the harness does not fail on a crash" >&2
    tail -20 "$OUT/canary.log" >&2
    exit 1
fi
grep -q "deadly signal\|ERROR: " "$OUT/canary.log" || { tail -20 "$OUT/canary.log" >&2; exit 1; }
rm -rf "$OUT"/canary-*

if ! "$OUT/fuzz_gguf" -max_total_time="$SECONDS_RUN" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$OUT/" "$OUT/corpus" "$OUT/seeds" > "$OUT/fuzz.log" 2>&1; then
    echo "fuzz_gguf: the fuzzer found a failure (input saved under $OUT/):" >&2
    grep -A30 "ERROR\|deadly signal\|Test unit written" "$OUT/fuzz.log" | head -60 >&2
    exit 1
fi
echo "fuzz_gguf: no crash in ${SECONDS_RUN} s; $(grep -o 'Done [0-9]* runs' "$OUT/fuzz.log" | tail -1)," \
     "corpus $(ls "$OUT/corpus" | wc -l) inputs"
