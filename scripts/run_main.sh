#!/usr/bin/env bash
# The main job: every workload in workloads/seed.jsonl on SmolLM2-135M-Instruct,
# greedy, with speculation off and on, through the running services; prints
# the table (time off/on, net effect, tokens/s, tries, hits, kv_rolls, identical).
# Extra arguments go to `echospec bench` (e.g. --json, --k 8).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# the default model's draft prior (its answers to general prompts; about 100 s, once)
.venv/bin/echospec prior --if-missing >/dev/null
exec .venv/bin/echospec bench --workloads workloads/seed.jsonl "$@"
