"""The verifier's per-round Python right after an engine forward, against the same code warm.

A forward streams every weight of the model through the caches of the core that runs it (the
verifier's generation thread: the engine computes on its caller's thread), so the Python that
follows, the round's accept, controller, scheduler and message work, runs from cold caches. This
times a fixed sample of that work (a scheduler step with a no-op engine, the spec controller's
plan and update, a round's protobuf message) on one thread, alternately right after a real
forward of the model (one decode step, or a verify of --k drafts) and again at once (warm), and
prints the medians and their ratio. Only the engine's forward sits between the two timings of a
pair; the host's drift cancels. Controls (--between): ``stream`` reads as many bytes as the
model's file in numpy instead of the forward (the caches evicted, no engine), ``sleep`` waits as
long as a forward takes (nothing evicted: the idle core's own cost, if any).

    .venv/bin/python tools/perf/cold_python.py                 # the default model (SmolLM2)
    .venv/bin/python tools/perf/cold_python.py --model M.gguf --k 4 --pairs 300 --json
    .venv/bin/python tools/perf/cold_python.py --between stream   # or sleep
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from echospec.services.verifier import engine as E  # noqa: E402
from echospec.services.verifier.controller import CostModel, SpecController  # noqa: E402
from echospec.services.verifier.scheduler import Scheduler, Step  # noqa: E402
from echospec.v1 import verifier_pb2  # noqa: E402


def round_sample(sched: Scheduler, fake_session, ctl: SpecController, k: int) -> None:
    """A fixed piece of a round's Python (its shape, not its exact code path)."""
    draft = list(range(10, 10 + k))
    for _ in range(3):
        sched.run(Step(fake_session, [1] + draft, "all", "none"))
        ctl.cache = list(range(10, 74))
        ctl.plan(k)
        ctl.on_result(draft, draft + [99])
        msg = verifier_pb2.GenerateTokensResponse()
        msg.rounds.add(result=verifier_pb2.StepResult(tokens=draft + [99], k=k, accepted=k, tries=1,
                                                       hits=k, t_ms=3.0, v_ms=4.0, n_past=100, n_ctx=2048),
                       wall_ms=4.2, proposals=1, source=1)
        msg.SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: the default model, fetched once)")
    ap.add_argument("--k", type=int, default=4, help="drafts of the forward between the pairs (0: a decode step)")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--between", choices=("forward", "stream", "sleep"), default="forward",
                    help="what runs before the first timing of a pair (the controls: see above)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.k < 0 or args.pairs < 1:
        ap.error("--k must be >= 0 and --pairs >= 1")
    path = args.model or subprocess.check_output(
        [sys.executable, str(ROOT / "scripts" / "fetch_model.py")], text=True).strip().splitlines()[-1]
    model = E.Model(path)
    session = model.new_session(n_ctx=512, n_threads=1)
    try:
        prompt = list(range(1, 65))
        session.forward(prompt)
        res = (np.zeros(args.k + 1, np.int32), None)
        sched = Scheduler(threading.Lock(), run_batch=lambda items: [res])
        fake = type("FakeSession", (), {"threads": 1})()
        ctl = SpecController(k=args.k or 1, cost=CostModel())
        feed = [5] + [6] * args.k
        t0 = time.perf_counter()
        session.forward(feed)
        session.rollback(len(prompt))
        forward_s = time.perf_counter() - t0
        big = np.ones(os.path.getsize(path) // 8) if args.between == "stream" else None
        cold, warm = [], []
        for i in range(args.pairs + 5):
            if args.between == "forward":
                session.forward(feed)
                session.rollback(len(prompt))
            elif args.between == "stream":
                big.sum()
            else:
                time.sleep(forward_s)
            t0 = time.perf_counter()
            round_sample(sched, fake, ctl, args.k or 1)
            t1 = time.perf_counter()
            round_sample(sched, fake, ctl, args.k or 1)
            t2 = time.perf_counter()
            if i >= 5:   # the first pairs warm up the interpreter and the model's pages
                cold.append((t1 - t0) * 1e6)
                warm.append((t2 - t1) * 1e6)
    finally:
        session.close()
        model.close()
    c, w = statistics.median(cold), statistics.median(warm)
    out = {"model": Path(path).name, "k": args.k, "between": args.between, "pairs": args.pairs,
           "simd": E.simd_name(),
           "after_forward_us": round(c, 1), "warm_us": round(w, 1), "ratio": round(c / w, 2)}
    if args.json:
        print(json.dumps(out))
    else:
        what = f"a forward of {args.k} drafts" if args.between == "forward" else \
            "a read of the model's size" if args.between == "stream" else "a sleep as long as a forward"
        print(f"{out['model']} ({out['simd']}): the round sample {c:.1f} us right after {what}, "
              f"{w:.1f} us warm ({c / w:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
