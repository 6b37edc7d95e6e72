"""Where a speculative round's time goes, per K and engine thread count.

For each n_threads and each K, greedy generations through the coordinator (in-process stack,
streamed Generate, speculation on, fixed K: adaptive_k off) on a workload that drafts every
round: the prompt asks to repeat a paragraph, and the request's prediction is the output that
plain greedy decoding gives (measured first, spec off), so the draft service proposes K tokens
a round and they are accepted. Outputs spec on must equal spec off byte for byte.

Per round, in ms (means over the generations' rounds after the prefill; from the result's
stats.round_cost, echospec.v1.RoundCost, timed by the verifier's generation loop):

    V        the engine's forward call (C) + KV rollback (the rollback is part of the accept step's timing
             in RoundCost and is moved here)
    draft    the draft link: a proposal asked and waited for, or the in-flight one collected,
             and the controller's choice and update
    accept   R, the bonus token, the logprobs when asked (rollback excluded: in V)
    sched    the scheduler step's wall time beyond the engine call: the Python that prepares the
             call and reads its results, the hand-off to its thread, the queue
    rest     the verifier loop's other per-round wall: its own Python, handing the round to the
             servicer, the gRPC sends on the same GIL (wall - V - draft - sched - accept)
    coord    the coordinator's per-round work as the client sees it: (client wall from the
             first streamed message to the last - the verifier's round walls) / rounds
    round    the client's wall per round (the sum of the above)
    T        the verifier's ms per plain decode step, from a spec-off generation of the same
             prompt run just before each K's (its output is the reference)
    ovh      round - V, and ovh/T in %

Usage:
    .venv/bin/python tools/perf/round_breakdown.py                    # SmolLM2, K 1..16, 1 and 2 threads
    .venv/bin/python tools/perf/round_breakdown.py --ks 1,4,8,16 --gens 2
    .venv/bin/python tools/perf/round_breakdown.py --quick --json     # tiny model, seconds (smoke)
    .venv/bin/python tools/perf/round_breakdown.py --processes        # the services as processes
    .venv/bin/python tools/perf/round_breakdown.py --no-verify-runs   # one engine call per round
"""
from __future__ import annotations

import os

# as in the services' entry points: OpenBLAS workers would spin on the engine's cores
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.stack import start_stack  # noqa: E402

PARAGRAPH = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He trimmed "
             "the wick, polished the great lens and wrote the weather in his log: wind from the "
             "west, a low grey sky, three ships passing to the north before the rain came in. "
             "At midnight he walked down to the kitchen, boiled water for tea and read the letters "
             "his sister sent from the city, where the trams ran all night and nobody looked at "
             "the sea. In the morning the supply boat came with flour, oil, candles, a crate of "
             "apples and the newspapers of the week, and the skipper stayed for an hour to talk.")
PROMPT = f"Repeat the following paragraph exactly, word for word.\n\n{PARAGRAPH}\n\nRepeat:\n"
COLS = ("v", "draft", "accept", "sched", "rest", "coord", "round")


def _generate(stub, **kw) -> tuple[cpb.GenerationResult, float, float]:
    """A streamed generation: its result, and the client's times (s) of the first and last
    message."""
    t_first = t_last = 0.0
    last = None
    for last in stub.Generate(cpb.GenerateRequest(**kw), timeout=600):
        t_last = time.perf_counter()
        if not t_first:
            t_first = t_last
    return last.result, t_first, t_last


def measure(stub, k: int, reference: str, gens: int, max_tokens: int) -> dict:
    """Means per round over ``gens`` generations at K = k (ms), T from a plain generation of the
    same prompt just before them."""
    sums = dict.fromkeys(COLS, 0.0)
    rounds = drafts = hits = 0
    plain, _, _ = _generate(stub, text=PROMPT, max_tokens=max_tokens, spec=common_pb2.SPEC_MODE_OFF,
                            temperature=0.0)
    if plain.text != reference:
        raise SystemExit(f"K={k}: plain decoding's output changed between runs")
    t = plain.stats.t_ms
    for _ in range(gens):
        res, t_first, t_last = _generate(stub, text=PROMPT, max_tokens=max_tokens,
                                         spec=common_pb2.SPEC_MODE_ON, k=k, prediction=reference,
                                         temperature=0.0)
        if res.text != reference:
            raise SystemExit(f"K={k}: the output differs from plain decoding's")
        st, rc = res.stats, res.stats.round_cost
        n = st.rounds
        if not n:
            continue
        verifier_ms = rc.wall_ms * n
        sums["v"] += (rc.v_ms + rc.rollback_ms) * n
        sums["draft"] += rc.draft_ms * n
        sums["accept"] += (rc.accept_ms - rc.rollback_ms) * n
        sums["sched"] += rc.sched_ms * n
        sums["rest"] += rc.rest_ms * n
        sums["coord"] += (t_last - t_first) * 1e3 - verifier_ms
        sums["round"] += (t_last - t_first) * 1e3
        rounds += n
        drafts += st.draft_tokens
        hits += st.hits
    out = {c: round(sums[c] / rounds, 4) if rounds else 0.0 for c in COLS}
    ovh = out["round"] - out["v"]
    out.update(k=k, rounds=rounds, drafts_per_round=round(drafts / rounds, 3) if rounds else 0.0,
               accepted_per_round=round(hits / rounds, 3) if rounds else 0.0, t=round(t, 4),
               ovh=round(ovh, 4), ovh_pct_t=round(100 * ovh / t, 2) if t else 0.0)
    return out


def run_threads(path: str, n_threads: int, ks: list[int], gens: int, max_tokens: int,
                processes: bool = False, verify_runs: bool = True) -> dict:
    stack = start_stack(path, spec=False, processes=processes, n_ctx=1024, n_threads=n_threads,
                        k=max(ks), max_tokens=max_tokens, adaptive_k=False, verify_runs=verify_runs)
    try:
        ch = grpc.insecure_channel(stack.target)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        ref, _, _ = _generate(stub, text=PROMPT, max_tokens=max_tokens, spec=common_pb2.SPEC_MODE_OFF,
                              temperature=0.0)
        rows = [measure(stub, k, ref.text, gens, max_tokens) for k in ks]
        ch.close()
    finally:
        stack.stop()
    return {"n_threads": n_threads, "tokens": len(ref.token_ids), "rows": rows}


def _model_path(name: str, tmp: Path) -> str:
    if name == "tiny":
        from ggufgen import write_tiny_model
        p = tmp / "tiny-llama.gguf"
        write_tiny_model(p, arch="llama", n_vocab=320, n_ctx_train=1024, seed=0)
        return str(p)
    if name == "smollm2":
        return subprocess.check_output([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                                       text=True).strip().splitlines()[-1]
    if not Path(name).is_file():
        raise SystemExit(f"--model {name}: no such file (tiny, smollm2 or a GGUF path)")
    return name


def _ints(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or a GGUF path")
    ap.add_argument("--ks", default="1-16", help="K values, e.g. 1-16 or 1,4,8,16")
    ap.add_argument("--threads", default="1,2", help="engine threads (the verifier's n_threads)")
    ap.add_argument("--gens", type=int, default=3, help="generations per K")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model, K 1 and 4, 1 thread, 1 generation of 24 tokens")
    ap.add_argument("--json", action="store_true", help="one JSON object per thread count")
    ap.add_argument("--processes", action="store_true",
                    help="each service its own process (as `echospec serve --processes` and "
                         "docker-compose run them); default: one process, as `echospec bench`")
    ap.add_argument("--no-verify-runs", action="store_true",
                    help="the verifier's --no-verify-runs: one engine call per round (no rounds "
                         "run in the engine over a longer proposal)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.ks, args.threads, args.gens, args.max_tokens = "tiny", "1,4", "1", 1, 24
    ks, threads = _ints(args.ks), _ints(args.threads)
    if not ks or min(ks) < 1 or not threads or min(threads) < 1 or args.gens < 1 or args.max_tokens < 2:
        ap.error("K, threads and gens must be >= 1, max-tokens >= 2")
    with tempfile.TemporaryDirectory() as td:
        path = _model_path(args.model, Path(td))
        results = [run_threads(path, nt, ks, args.gens, args.max_tokens, args.processes,
                               not args.no_verify_runs) for nt in threads]
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    print(f"per round, ms (means over rounds; {args.gens} generation(s) per K of"
          f" {'/'.join(str(r['tokens']) for r in results)} tokens (per thread count);"
          f" model {Path(path).name if args.model not in ('tiny', 'smollm2') else args.model})")
    print(f"{'thr':>3} {'K':>3} {'k/rd':>5} {'R/rd':>5} {'T':>6} | "
          + " ".join(f"{c:>6}" for c in COLS) + f" | {'ovh':>6} {'ovh/T':>6}")
    for r in results:
        for row in r["rows"]:
            print(f"{r['n_threads']:>3} {row['k']:>3} {row['drafts_per_round']:>5.2f}"
                  f" {row['accepted_per_round']:>5.2f} {row['t']:>6.3f} | "
                  + " ".join(f"{row[c]:>6.3f}" for c in COLS)
                  + f" | {row['ovh']:>6.3f} {row['ovh_pct_t']:>5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
