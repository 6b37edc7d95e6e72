"""Per-round overhead of the services: a round's wall time minus V.

The overhead is the third term of the gain condition V + overhead < (R + 1) * T
and taxes every plain decode step, so it is measured here on its own:

    echo      a bare bidi-stream message round trip (bytes in, bytes back) on
              a server built like ours: the floor of one hop on this machine,
              with the queue-fed BidiStream back to back and after an idle gap
              of --gap-ms (about T: during a verifier forward both sides' gRPC
              threads sit idle, and waking them after several ms costs more).
    complete, generate
              greedy generations through the coordinator (unary Complete and
              streamed Generate), spec off and on; the figure is the result's
              stats.overhead_ms (mean per round of one generation, measured
              by the loop in the verifier), p50/mean
              over the generations, and e2e: the client's wall time per round
              beyond prefill and V. Outputs off vs on must be byte-identical.

Both stack modes are measured: in-process (three servers, one process, one
GIL) and processes=True (as `echospec serve --processes` / docker-compose).

Usage:
    .venv/bin/python tools/perf/round_overhead.py                 # tiny model + SmolLM2, both modes
    .venv/bin/python tools/perf/round_overhead.py --models tiny --modes threads
    .venv/bin/python tools/perf/round_overhead.py --json          # one JSON object per (model, mode)
All times are ms.
"""
from __future__ import annotations

import os

# as in the services' entry points: OpenBLAS workers would spin on the engine's cores
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.services.rpc import grpc_util  # noqa: E402
from echospec.services.rpc.streams import BidiStream  # noqa: E402
from echospec.stack import start_stack  # noqa: E402

ECHO_METHOD = "/echospec.bench.Echo/Echo"
PROMPTS = [
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "Count: one two three four five six seven eight nine ten, one two three four five",
    "Write a Python function that adds two numbers.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _summ(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(_pct(xs, 0.5), 4), "p90": round(_pct(xs, 0.9), 4),
            "mean": round(statistics.fmean(xs), 4) if xs else 0.0}


# -- echo baseline -------------------------------------------------------------------------------
def _echo_handler():
    def echo(it, context):  # noqa: ARG001
        for m in it:
            yield m
    return grpc.method_handlers_generic_handler("echospec.bench.Echo", {
        "Echo": grpc.stream_stream_rpc_method_handler(echo)})


def echo_server(port: int = 0) -> tuple[grpc.Server, int]:
    """A bidi echo server built with the services' own builder (options, thread pool)."""
    h = grpc_util.build_server("127.0.0.1", port, 16, 1 << 20, ["echospec.bench.Echo"])
    h.server.add_generic_rpc_handlers((_echo_handler(),))
    h.server.start()
    return h.server, h.port


def echo_rtt(target: str, n: int, gap_ms: float = 0.0) -> dict:
    """Round trips of a 32-byte message on one bidi stream.

    Args:
        gap_ms: idle time before each round trip (a verifier forward of T ms
            leaves both sides' gRPC threads idle that long; waking them costs).
    """
    ch = grpc_util.channel(target, 1 << 20)
    method = ch.stream_stream(ECHO_METHOD)
    s = BidiStream(method)
    payload = b"x" * 32
    for _ in range(20):
        s.request(payload)
    xs = []
    for _ in range(n):
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        s.request(payload)
        xs.append((time.perf_counter() - t0) * 1e3)
    s.close()
    ch.close()
    return _summ(xs)


# -- generations ---------------------------------------------------------------------------------
def _call(stub, stream: bool, **kw) -> cpb.GenerationResult:
    if not stream:
        return stub.Complete(cpb.CompleteRequest(**kw), timeout=600).result
    last = None
    for last in stub.Generate(cpb.GenerateRequest(**kw), timeout=600):
        pass
    return last.result


def generations(target: str, prompts: list[str], max_tokens: int, reps: int) -> dict:
    """Complete and Generate (streamed), spec off and on.

    overhead_ms: the result's stats.overhead_ms (the verifier loop's round wall - V).
    e2e_ms: (client wall - prefill - rounds * V) / rounds per generation: what
    the client pays per round beyond the verifier's forwards (request setup,
    tokenizing and, for Generate, streaming the deltas are in it).
    """
    ch = grpc.insecure_channel(target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    out: dict = {}
    texts: dict = {}
    for call in ("complete", "generate"):
        for mode, spec in (("off", common_pb2.SPEC_MODE_OFF), ("on", common_pb2.SPEC_MODE_ON)):
            over, e2e, ts, vs, rounds, secs = [], [], [], [], 0, 0.0
            for _ in range(reps):
                for i, p in enumerate(prompts):
                    t0 = time.perf_counter()
                    res = _call(stub, call == "generate", text=p, max_tokens=max_tokens, spec=spec,
                                temperature=0.0)
                    wall = time.perf_counter() - t0
                    secs += wall
                    st = res.stats
                    over.append(st.overhead_ms)
                    if st.rounds:
                        e2e.append((wall * 1e3 - st.prefill_ms - st.v_ms * st.rounds) / st.rounds)
                    ts.append(st.t_ms)
                    vs.append(st.v_ms)
                    rounds += st.rounds
                    texts.setdefault((mode, i), res.text)
                    if texts[(mode, i)] != res.text:
                        raise SystemExit(f"output differs for prompt {i} ({call}, spec {mode})")
            out[f"{call}_{mode}"] = {"overhead_ms": _summ(over), "e2e_ms": _summ(e2e),
                                     "t_ms": round(statistics.fmean(ts), 4),
                                     "v_ms": round(statistics.fmean(vs), 4), "rounds": rounds,
                                     "seconds": round(secs, 3)}
    out["identical"] = all(texts[("off", i)] == texts[("on", i)] for i in range(len(prompts)))
    ch.close()
    return out


def _model_path(name: str, tmp: Path) -> str:
    if name == "tiny":
        from ggufgen import write_tiny_model
        p = tmp / "tiny-llama.gguf"
        write_tiny_model(p, arch="llama", n_vocab=320, n_ctx_train=512, seed=0)
        return str(p)
    return subprocess.check_output([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                                   text=True).strip().splitlines()[-1]


def run(model: str, path: str, mode: str, args) -> dict:
    n_threads = 1 if model == "tiny" else 0
    stack = start_stack(path, spec=False, processes=(mode == "processes"), n_ctx=512,
                        n_threads=n_threads, k=4, max_tokens=256)
    try:
        gen = generations(stack.target, PROMPTS, args.max_tokens if model == "tiny" else 64,
                          args.reps)
    finally:
        stack.stop()
    return {"model": model, "mode": mode, "generate": gen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--modes", default="threads,processes")
    ap.add_argument("--echo-rounds", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=9.0, help="idle gap of the third echo figure")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    results = []
    srv, port = echo_server()
    target = f"127.0.0.1:{port}"
    echo = {"bidi": echo_rtt(target, args.echo_rounds),
            f"bidi_after_{args.gap_ms:g}ms_idle": echo_rtt(target, max(50, args.echo_rounds // 20),
                                                         args.gap_ms)}
    srv.stop(0)
    results.append({"echo_rtt_ms": echo})
    with tempfile.TemporaryDirectory() as td:
        for model in args.models.split(","):
            path = _model_path(model, Path(td))
            for mode in args.modes.split(","):
                results.append(run(model, path, mode, args))
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    for name, e in echo.items():
        print(f"echo round trip, in-process server, {name:22}: p50 {e['p50']:.3f}  mean {e['mean']:.3f}"
              f"  p90 {e['p90']:.3f} ms")
    print("per-round overhead, ms: complete/generate = the"
          " result's stats.overhead_ms (p50 over generations); e2e = client-side (wall - prefill"
          " - rounds * V) / rounds (p50)")
    cols = [f"{c}_{m}" for c in ("complete", "generate") for m in ("off", "on")]
    print(f"{'model':8} {'mode':10} {'T':>7} | "
          + " ".join(f"{c:>12} {'e2e':>6}" for c in cols) + " | ident")
    for r in results[1:]:
        g = r["generate"]
        print(f"{r['model']:8} {r['mode']:10} {g['complete_off']['t_ms']:7.3f} | "
              + " ".join(f"{g[c]['overhead_ms']['p50']:12.3f} {g[c]['e2e_ms']['p50']:6.3f}" for c in cols)
              + f" | {g['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
