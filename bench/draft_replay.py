"""Drafting quality without the clock: replay each workload's greedy output through a
drafter and count the verify rounds it would need (load-independent; the CPU is shared).

For each workload: the prompt (the chat template applied) and its greedy output (speculation off,
through the services: the output is the same with speculation on). Then, for a drafter and a
draft length K, rounds are replayed as the verifier runs them with a fixed K: propose up to K
tokens from the history, accept the longest prefix equal to the real output, append the accepted
tokens and the bonus token. Drafters: "ngram" (the exact-repeat rule,
NgramProposer 2..5) and "sources" (DraftProposer: prediction, numbered, suffix; no shared memory).

Estimated speedup = output tokens / sum over rounds of V(K_r)/T, with V(K)/T interpolated from
``--ratios`` (V(K)/T measured by engine_bench on a quiet host, see bench/README.md; K = 0 is 1).
No overheads (draft hop, Python loop) and no cost model: an upper bound of what drafting gives
at that engine speed. ``est_speedup_oracle_k``: the same rounds, each verifying only the drafts
it keeps (a round's length chosen knowing the output): the ceiling of any choice of K over
these proposals.

    .venv/bin/python bench/draft_replay.py [--k 4 8 16] [--ratios 1:1.07,2:1.13,4:1.26,8:1.89,16:3.17]
        [--workloads workloads/varied.jsonl]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import grpc

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from echospec.services.text.chat_template import ChatTemplate
from echospec.services.text.tokenizer import Tokenizer
from echospec.services.coordinator.servicer import digit_tokens, line_break_tokens
from echospec.stack import start_stack
from echospec.services.draft.proposer import DraftProposer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ngram_reference import NgramProposer  # noqa: E402  the exact-repeat rule, kept with the tests


def ratio(k: int, table: dict[int, float]) -> float:
    """V(K)/T by linear interpolation (and extrapolation past the last point)."""
    pts = sorted({0: 1.0, **table}.items())
    for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
        if k <= k1:
            return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
    (k0, r0), (k1, r1) = pts[-2], pts[-1]
    return r1 + (r1 - r0) * (k - k1) / (k1 - k0)


def replay(prompt: list[int], output: list[int], make, k: int, table) -> dict:
    """Rounds a drafter needs for ``output`` (the first output token comes from the prefill)."""
    p = make()
    p.append(prompt)
    if hasattr(p, "start_output"):
        p.start_output()
    p.append(output[:1])
    i, rounds, cost, best, drafts, hits = 1, 0, 0.0, 0.0, 0, 0
    while i < len(output):
        d = p.propose(min(k, len(output) - i - 1 if len(output) - i > 1 else 0))[0] \
            if len(output) - i > 1 else []
        r = 0
        while r < len(d) and output[i + r] == d[r]:
            r += 1
        step = output[i:i + r + 1]
        p.append(step)
        i += len(step)
        rounds += 1
        cost += ratio(len(d), table)
        best += ratio(r, table)
        drafts += 1 if d else 0
        hits += r
    n = len(output) - 1
    return {"rounds": rounds, "tries": drafts, "hits": hits,
            "mean_acceptance_length": round(1 + hits / drafts, 2) if drafts else 1.0,
            "est_speedup": round(n / cost, 2) if cost else 1.0,
            "est_speedup_oracle_k": round(n / best, 2) if best else 1.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--ratios", default="1:1.07,2:1.13,4:1.26,8:1.89,16:3.17")
    ap.add_argument("--model")
    ap.add_argument("--workloads", default=str(ROOT / "workloads" / "seed.jsonl"),
                    help="JSONL of workloads (messages or prompt, max_tokens, prediction)")
    args = ap.parse_args()
    table = {int(a): float(b) for a, b in (x.split(":") for x in args.ratios.split(","))}
    model = args.model or subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                                         capture_output=True, text=True, check=True).stdout.split()[-1]
    tok = Tokenizer.from_gguf(model)
    tmpl = ChatTemplate.from_gguf(model)
    digits = digit_tokens(tok)
    breaks = line_break_tokens(tok)
    try:
        works = [json.loads(line) for line in open(args.workloads, encoding="utf-8") if line.strip()]
    except (OSError, ValueError) as exc:
        ap.error(f"--workloads {args.workloads}: {exc}")
    st = start_stack(model, n_ctx=2048)
    ch = grpc.insecure_channel(st.target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    try:
        for w in works:
            msgs = w.get("messages")
            prompt = tok.encode(tmpl.render(msgs, add_generation_prompt=True) if msgs else w["prompt"])
            req = cpb.CompleteRequest(max_tokens=w.get("max_tokens", 256), spec=common_pb2.SPEC_MODE_OFF)
            if msgs:
                req.messages.extend(cpb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs)
            else:
                req.text = w["prompt"]
            out = list(stub.Complete(req, timeout=600).result.token_ids)
            pred = tok.encode(w.get("prediction", ""))
            row = {"id": w["id"], "tokens": len(out)}
            for k in args.k:
                row[f"ngram_k{k}"] = replay(prompt, out, NgramProposer, k, table)
                row[f"sources_k{k}"] = replay(prompt, out, lambda: DraftProposer(
                    prediction=pred, digits=digits, line_breaks=breaks), k, table)
            print(json.dumps(row), flush=True)
    finally:
        ch.close()
        st.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
