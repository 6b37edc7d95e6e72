"""Token-tree verification cost: V(tree of N nodes) against V(chain of N) and T, on one engine.

What it measures (greedy, fixed pseudo-random token ids, a context of --depth tokens first):

    T_ms            one decode step (N = 1) at depth --depth, milliseconds.
    chain_ms[N]     Session.forward over N new tokens (a verify of N - 1 drafts), then a rollback
                    to the depth: the chain's V(N - 1).
    tree_ms[N]      Session.forward_tree over a tree of N nodes at the same depth: a root and
                    --branches branches from it of (N - 1) / branches nodes each (the rest on the
                    first), every node's argmax; nothing kept (n_past does not move).
    tree_over_chain[N]  tree_ms / chain_ms: what verifying a tree costs beyond a chain of as many
                    tokens (both read the weights once; the tree's attention assembles each
                    branch node's last KV blocks).

The host drifts over minutes, so the two are measured ALTERNATELY: each round times --reps calls of
one, then of the other, the order flipping every round; a figure is the median over rounds of the
per-round median, and the ratio the median of the per-round ratios.

Usage:
    python bench/tree_bench.py                      # SmolLM2 (fetched on first use), 2 threads
    python bench/tree_bench.py --json --nodes 4 8 16 --branches 3 --depth 256
Progress goes to stderr. Exit status 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from echospec.services.verifier.engine import Model, simd_name  # noqa: E402


def tree_shape(n: int, branches: int) -> list[int]:
    """Parents of a root plus `branches` chains hanging from it, (n - 1) // branches nodes each
    (the remainder on the first). n = 1 is the root alone."""
    parents = [-1]
    rest = n - 1
    b = min(branches, rest) if rest > 0 else 0
    for k in range(b):
        length = rest // b + (1 if k < rest % b else 0)
        prev = 0
        for _ in range(length):
            parents.append(prev)
            prev = len(parents) - 1
    return parents


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _smollm2() -> str:
    spec = importlib.util.spec_from_file_location("fetch_model", REPO / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.fetch(verbose=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2, fetched)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    path = a.model or _smollm2()
    with Model(path) as m:
        nv = m.info.n_vocab
        with m.new_session(n_ctx=a.depth + max(a.nodes) + 64, n_threads=a.threads) as s:
            s.forward([(p * 7919 + 13) % nv for p in range(a.depth)])
            toks = {n: [(i * 104729 + 7) % nv for i in range(n)] for n in a.nodes}
            shapes = {n: tree_shape(n, a.branches) for n in a.nodes}

            def chain(n):
                s.forward(toks[n])
                s.rollback(a.depth)

            def tree(n):
                s.forward_tree(toks[n], shapes[n])

            def step():
                s.forward([1])
                s.rollback(a.depth)

            for n in a.nodes:   # warm up
                chain(n)
                tree(n)
            t_ms, c_ms, r_ms, ratio = [], {n: [] for n in a.nodes}, {n: [] for n in a.nodes}, {n: [] for n in a.nodes}
            for r in range(a.rounds):
                t_ms.append(timed(step, a.reps))
                for n in a.nodes:
                    if r % 2 == 0:
                        c, t = timed(lambda: chain(n), a.reps), timed(lambda: tree(n), a.reps)
                    else:
                        t, c = timed(lambda: tree(n), a.reps), timed(lambda: chain(n), a.reps)
                    c_ms[n].append(c)
                    r_ms[n].append(t)
                    ratio[n].append(t / c)
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    res = {
        "model": Path(path).name, "threads": a.threads, "depth": a.depth, "branches": a.branches,
        "simd": simd_name(), "rounds": a.rounds, "reps": a.reps,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "T_ms": round(statistics.median(t_ms), 2),
        "chain_ms": {str(n): round(statistics.median(c_ms[n]), 2) for n in a.nodes},
        "tree_ms": {str(n): round(statistics.median(r_ms[n]), 2) for n in a.nodes},
        "tree_over_chain": {str(n): round(statistics.median(ratio[n]), 3) for n in a.nodes},
    }
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model']}  simd {res['simd']}  threads {a.threads}  depth {a.depth}  T {res['T_ms']} ms  "
          f"load {res['loadavg_1m']}")
    print("  N   chain_ms   tree_ms   tree/chain   (tree: a root + %d branches)" % a.branches)
    for n in a.nodes:
        k = str(n)
        print(f"{n:3d}   {res['chain_ms'][k]:8.2f}  {res['tree_ms'][k]:8.2f}   {res['tree_over_chain'][k]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
