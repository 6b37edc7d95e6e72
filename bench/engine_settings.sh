#!/usr/bin/env bash
# engine_bench.py with the peer over the board's file types: one `engine_bench.py --json` run per
# setting, one JSON file per setting in OUTDIR (a directory the caller names), then the table of all
# of OUTDIR's results (bench/engine_table.py).
#
#   bench/engine_settings.sh OUTDIR [SIMD [ROUNDS]]
#     SIMD    installed (default), native, avx512, avx2 or scalar (engine_bench.py --simd)
#     ROUNDS  measured rounds per engine (default 4)
#   ONLY="q4_1 q4_k_m" bench/engine_settings.sh ...   runs only the named settings
#   THREADS=1 bench/engine_settings.sh ...             threads for both engines (default 2)
#   EXTRA="--peer-flash-attn" TAG=fa bench/engine_settings.sh ...   more engine_bench flags; TAG goes
#                                                      into the file names (OUTDIR/NAME.SIMD.tT.TAG.json)
#
# Settings: q4_1 (SmolLM2 Q4_1, depth 64), q4_k_m and q8_0 (SmolLM2 requantized), qwen3_06b_q4_k_m
# (the Qwen3-0.6B shape), q4_1_d2048 (SmolLM2 Q4_1 at depth 2048 with a 2048-token prefill).
# The files come from bench/qwen3_shapes.py (run it first). Runs are sequential: two runs at once
# on a 2-core host would measure each other.
set -euo pipefail
out=${1:?usage: bench/engine_settings.sh OUTDIR [SIMD [ROUNDS]]}
mkdir -p "$out"
out=$(cd "$out" && pwd)            # OUTDIR as the caller meant it, before the cd below
cd "$(dirname "$0")/.."
simd=${2:-installed}
rounds=${3:-4}
threads=${THREADS:-2}
tag=${TAG:+.$TAG}
py=.venv/bin/python
cache=${ECHOSPEC_CACHE:-$HOME/.cache/echospec}
q41=$($py scripts/fetch_model.py)
declare -A model=(
  [q4_1]=$q41
  [q4_k_m]=$cache/bench/SmolLM2-135M-Instruct.Q4_K_M.gguf
  [q8_0]=$cache/bench/SmolLM2-135M-Instruct.Q8_0.gguf
  [qwen3_06b_q4_k_m]=$cache/bench/qwen3-0.6B-shape.Q4_K_M.gguf
  [q4_1_d2048]=$q41
)
declare -A extra=([q4_1_d2048]="--depth 2048 --prompt-tokens 2048")
for name in ${ONLY:-q4_1 q4_k_m q8_0 qwen3_06b_q4_k_m q4_1_d2048}; do
  m=${model[$name]:?unknown setting $name}
  [ -f "$m" ] || { echo "engine_settings: $m is missing (run bench/qwen3_shapes.py)" >&2; exit 2; }
  dest=$out/${name}.${simd}.t${threads}${tag}.json
  echo "engine_settings: $name ($simd) -> $dest (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  # shellcheck disable=SC2086
  $py bench/engine_bench.py --json --model "$m" --simd "$simd" --rounds "$rounds" --threads "$threads" \
    ${extra[$name]:-} ${EXTRA:-} > "$dest.tmp"
  mv "$dest.tmp" "$dest"
done
$py bench/engine_table.py "$out"
