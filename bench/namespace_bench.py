"""Cross-request draft memory through the services: a second code edit of the same file, after a
first one in the same draft_namespace, against the same request without a namespace and with
speculation off (off / no namespace / namespace alternate, `--repeat` times; medians).

    .venv/bin/python bench/namespace_bench.py [--repeat 3] [--max-tokens 256] [--model PATH]

Each namespace run uses a fresh namespace holding only the first edit's generation, so the
repeats measure the same situation. Prints one JSON object per variant and a summary line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from echospec.stack import start_stack

ROOT = Path(__file__).resolve().parents[1]


def code_edit_messages(instruction: str) -> list[cpb.ChatMessage]:
    w = next(json.loads(l) for l in open(ROOT / "workloads" / "seed.jsonl") if '"code_edit"' in l)
    content = w["messages"][0]["content"]
    head = content[:content.rindex("```") + 3]
    return [cpb.ChatMessage(role="user", content=f"{head}\n\n{instruction}")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model")
    args = ap.parse_args()
    model = args.model or subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                                         capture_output=True, text=True, check=True).stdout.split()[-1]
    first = code_edit_messages("Return the same function with the variable `totals` renamed to "
                               "`customer_totals`. Change nothing else. Output only the code.")
    second = code_edit_messages("Return the same function with the variable `counts` renamed to "
                                "`order_counts`. Change nothing else. Output only the code.")
    st = start_stack(model, n_ctx=2048)
    ch = grpc.insecure_channel(st.target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)

    def run(msgs, spec, ns=""):
        t0 = time.perf_counter()
        r = stub.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=args.max_tokens, spec=spec,
                                              draft_namespace=ns), timeout=600).result
        return time.perf_counter() - t0, r

    try:
        run(second, common_pb2.SPEC_MODE_OFF)                       # warm-up
        times: dict[str, list[float]] = {"off": [], "on": [], "on_namespace": []}
        last = {}
        for i in range(args.repeat):
            ns = f"bench-{time.time_ns()}-{i}"
            run(first, common_pb2.SPEC_MODE_ON, ns)                 # the namespace's memory
            for name, spec, n in (("off", common_pb2.SPEC_MODE_OFF, ""), ("on", common_pb2.SPEC_MODE_ON, ""),
                                  ("on_namespace", common_pb2.SPEC_MODE_ON, ns)):
                dt, r = run(second, spec, n)
                times[name].append(dt)
                last[name] = r
        base = list(last["off"].token_ids)
        for name, r in last.items():
            s = r.stats
            print(json.dumps({"variant": name, "seconds": [round(t, 3) for t in times[name]],
                              "median_s": round(statistics.median(times[name]), 3),
                              "tokens": r.completion_tokens, "identical": list(r.token_ids) == base,
                              "rounds": s.rounds, "tries": s.tries, "hits": s.hits,
                              "draft_tokens": s.draft_tokens, "t_ms": round(s.t_ms, 3),
                              "v_ms": round(s.v_ms, 3),
                              "sources": {x.source: [x.draft_tokens, x.hits, x.tries] for x in s.sources}}))
        off = statistics.median(times["off"])
        print(f"speedup: on {off / statistics.median(times['on']):.2f}x, "
              f"on with the namespace {off / statistics.median(times['on_namespace']):.2f}x")
    finally:
        ch.close()
        st.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
