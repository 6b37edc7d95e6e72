"""Where the time goes when N clients decode at once through the stack (threads mode, one process).

Starts a stack (start_stack, batch_max N, prefix cache off, greedy, speculation off), warms it
with one all-at-once round, then runs --reps rounds of N concurrent streamed generations of
--max-tokens tokens and reports per round, from inside this process:

    tok_s               output tokens / wall time of the round
    iterations, rows    the scheduler's iterations and the mean sessions per iteration
    forward_share       time inside the iterations' engine calls (Scheduler._run_batch) / wall
    forward_ms          mean engine call per iteration
    engine_cpu_share    CPU time of the thread in es_forward_batch / its wall time (below 1: the
                        engine thread was descheduled during the call, by this process's other
                        threads or by other processes on the host)
    gap_ms              median time from the end of an iteration to the submission of the last
                        step of the next full iteration (the stack's own per-iteration latency)
    verifier_msgs_per_token, client_msgs_per_token
                        GenerateTokens messages (verifier -> coordinator) and Generate messages
                        (coordinator -> client) per output token
    engine_alone_forward_ms
                        right after the round, the median of 20 es_forward_batch calls of the N
                        sessions' shape (N sessions x 1 token, about the round's context) on the
                        engine alone, on the verifier's model and batch_threads: forward_ms
                        over it is what running beside the stack's Python costs the forward
    cpu_ms_per_token    this process's CPU time (user + system) per output token, engine included
    stack_cpu_ms_per_token
                        the same less the engine calls' CPU time: the services', gRPC's and the
                        clients' own cost per token (on the host's other core while the engine runs)

Usage:
    .venv/bin/python tools/perf/serve_profile.py [--clients 8] [--max-tokens 64] [--reps 3] [--model PATH|tiny]
Prints one JSON object per round on stdout. Load-independent figures are the gap, the message
counts and the forward share; tok/s follows the host's load.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

import serve_bench as sb  # noqa: E402
from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.stack import start_stack  # noqa: E402
import echospec.services.verifier.engine as engine_mod  # noqa: E402
import echospec.services.verifier.servicer as vservicer  # noqa: E402


class _TimedLib:
    """engine_mod.lib with es_forward_batch timed (wall and the calling thread's CPU)."""

    def __init__(self, lib, calls: list):
        self._lib, self._calls = lib, calls

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def es_forward_batch(self, *a):
        t0, c0 = time.perf_counter(), time.thread_time()
        r = self._lib.es_forward_batch(*a)
        self._calls.append((time.perf_counter() - t0, time.thread_time() - c0))
        return r


def engine_alone_ms(core, prompts: list, extra: int, calls: int = 20) -> float:
    """Median ms of an es_forward_batch of len(prompts) sessions x 1 token, each session at its
    prompt plus ``extra`` tokens, on the verifier's model and batch_threads."""
    cfg = core.config
    ss = [core.model.new_session(n_ctx=cfg.n_ctx, n_threads=core.pool_threads) for _ in prompts]
    try:
        for s, p in zip(ss, prompts):
            s.prefill(list(p) + [p[-1]] * extra)
        ss[0].threads = cfg.batch_threads if len(ss) > 1 else cfg.n_threads
        ts = []
        for i in range(calls):
            t0 = time.perf_counter()
            engine_mod.forward_batch([(s, [7 + i], "all", "none") for s in ss])
            ts.append((time.perf_counter() - t0) * 1e3)
            for s in ss:
                s.rollback(s.n_past - 1)
        return statistics.median(ts)
    finally:
        for s in ss:
            s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batch-threads", type=int, default=0)
    args = ap.parse_args()
    n = args.clients
    with tempfile.TemporaryDirectory() as td:
        path = sb._model_path(args.model, Path(td))
        st = start_stack(path, n_ctx=2048, n_threads=args.threads, batch_threads=args.batch_threads,
                         batch_max=n, prefix_cache=False, max_tokens=args.max_tokens)
        sched = st.verifier.core.scheduler
        calls: list = []
        iters: list = []          # (start, end, sorted submit times) per iteration
        run_batch = sched._run_batch

        def timed_batch(items):
            t0 = time.perf_counter()
            r = run_batch(items)
            iters[-1][1] = time.perf_counter() - t0
            return r
        execute = sched._execute

        def timed_execute(batch, *rest):
            iters.append([time.perf_counter(), 0.0, sorted(s._t_submit for s in batch), 0.0])
            execute(batch, *rest)
            iters[-1][3] = time.perf_counter()
        sched._run_batch = timed_batch
        sched._execute = timed_execute
        engine_mod.lib = _TimedLib(engine_mod.lib, calls)
        vmsgs = [0]
        to_proto = vservicer.events_to_proto

        def counted(evs):
            vmsgs[0] += 1
            return to_proto(evs)
        vservicer.events_to_proto = counted
        ch = grpc.insecure_channel(st.target)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        try:
            n_vocab = stub.GetInfo(cpb.GetInfoRequest()).n_vocab
            prompts = [sb._prompt_ids(stub, 100 + i, 24, n_vocab) for i in range(n)]

            def at_once(max_tokens: int) -> list:
                def client(i):
                    ids, msgs = [], 0
                    for m in stub.Generate(cpb.GenerateRequest(token_ids=prompts[i], max_tokens=max_tokens,
                                                               spec=sb.OFF, temperature=0.0), timeout=600):
                        msgs += 1
                        ids.extend(m.token_ids)
                    return ids, msgs
                return sb.in_threads(n, client)

            at_once(8)
            for rep in range(args.reps):
                calls.clear()
                iters.clear()
                vmsgs[0] = 0
                c0 = os.times()
                t0 = time.perf_counter()
                runs = at_once(args.max_tokens)
                wall = time.perf_counter() - t0
                c1 = os.times()
                toks = sum(len(r[0]) for r in runs)
                round_calls = list(calls)     # the round's engine calls (not the engine-alone ones)
                alone_ms = engine_alone_ms(st.verifier.core, prompts, args.max_tokens // 2)
                gaps = [(b[2][-1] - a[3]) * 1e3 for a, b in zip(iters, iters[1:]) if len(b[2]) == n]
                fwd = sum(it[1] for it in iters)
                print(json.dumps({
                    "rep": rep, "tok_s": round(toks / wall, 1), "iterations": len(iters),
                    "rows": round(sum(len(it[2]) for it in iters) / max(1, len(iters)), 2),
                    "forward_share": round(fwd / wall, 3),
                    "forward_ms": round(fwd / max(1, len(iters)) * 1e3, 2),
                    "engine_alone_forward_ms": round(alone_ms, 2),
                    "engine_cpu_share": round(sum(c for _, c in round_calls)
                                              / max(1e-9, sum(w for w, _ in round_calls)), 3),
                    "gap_ms": round(statistics.median(gaps), 3) if gaps else None,
                    "verifier_msgs_per_token": round(vmsgs[0] / toks, 3),
                    "client_msgs_per_token": round(sum(r[1] for r in runs) / toks, 3),
                    "cpu_ms_per_token": round((c1.user - c0.user + c1.system - c0.system) / toks * 1e3, 3),
                    "stack_cpu_ms_per_token": round((c1.user - c0.user + c1.system - c0.system
                                                     - sum(c for _, c in round_calls)) / toks * 1e3, 3),
                    "load": float(open("/proc/loadavg").read().split()[0])}), flush=True)
        finally:
            ch.close()
            st.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
