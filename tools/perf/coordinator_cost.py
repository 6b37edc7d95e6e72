"""The coordinator's CPU cost per generated token, on loopback (deploy/FLEET.md uses it).

Starts a stack in processes mode (draft, verifier, coordinator: one process each), runs
CLIENTS concurrent streaming generations of TOKENS tokens each, repeated ROUNDS times, and
reads each process's CPU time (user + system, /proc/<pid>/stat) before and after. The
coordinator's CPU seconds / tokens streamed is its per-token cost: detokenizing, stop
matching, streaming to the client and reading the verifier's messages, plus gRPC.

The verifier runs a random-weight model (tests/ggufgen.py) sized so that a decode step
takes about a millisecond or more on one thread: the verifier's loop then sends about one
message per token, the coordinator's most expensive case (a slower verifier batches
several tokens per message less often still, so the per-token cost is the same; a faster
one batches more and lowers it).

    python tools/perf/coordinator_cost.py --json [--clients 4] [--tokens 400] [--rounds 3]

Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

from ggufgen import write_tiny_model  # noqa: E402
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.stack import start_stack  # noqa: E402


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=256, help="the verifier model's width")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n_ctx = 2048
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "m.gguf", arch="llama", n_vocab=320, n_layer=4,
                                 n_embd=args.n_embd, n_ff=2 * args.n_embd, n_ctx_train=n_ctx,
                                 seed=0).path
        st = start_stack(model, processes=True, n_ctx=n_ctx, n_threads=1, max_tokens=args.tokens,
                         log_level="WARNING")
        try:
            ch = grpc.insecure_channel(st.target)
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)

            def one(i: int) -> tuple[int, int]:
                msgs = toks = 0
                for r in stub.Generate(cpb.GenerateRequest(
                        text=f"client {i} writes", max_tokens=args.tokens,
                        spec=common_pb2.SPEC_MODE_OFF), timeout=600):
                    if r.token_ids:
                        msgs += 1
                        toks += len(r.token_ids)
                return msgs, toks

            one(0)   # warm-up
            pids = {n: p.pid for n, p in st._procs.items()}
            before = {n: cpu_s(p) for n, p in pids.items()}
            t0 = time.perf_counter()
            msgs = toks = 0
            with ThreadPoolExecutor(args.clients) as ex:
                for _ in range(args.rounds):
                    for m, t in ex.map(one, range(args.clients)):
                        msgs += m
                        toks += t
            wall = time.perf_counter() - t0
            used = {n: cpu_s(p) - before[n] for n, p in pids.items()}
            ch.close()
        finally:
            st.stop()
    out = {
        "clients": args.clients, "tokens": toks, "messages_to_client": msgs, "wall_s": round(wall, 3),
        "tokens_per_s": round(toks / wall, 1),
        "coordinator_cpu_s": round(used["coordinator"], 3),
        "coordinator_cpu_us_per_token": round(1e6 * used["coordinator"] / toks, 1),
        "verifier_cpu_us_per_token": round(1e6 * used["verifier"] / toks, 1),
        "coordinator_tokens_per_cpu_s": round(toks / used["coordinator"]) if used["coordinator"] else None,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
