"""The cost of constrained output per token: the grammar's mask against T, a decode step.

For each workload with a grammar (default workloads/structured_json.jsonl), a greedy constrained
generation runs on the engine directly, one token per step, as the verifier's loop does without
speculation: the matcher computes the allowed tokens (llguidance's bitmask, unpacked to a bool
row), the masked argmax picks the token, the matcher consumes it, and the engine runs the step.
It prints, per workload and overall, the medians of

    mask_ms      computing the allowed tokens (services/text/grammar.py Constraint.allowed)
    argmax_ms    the masked argmax over the logits row (numpy)
    T_ms         the engine's decode step with a logits row
    share        (mask_ms + argmax_ms) / T_ms
    forced       the share of tokens the grammar forced (llguidance's fast-forward tokens), the
                 ones speculation drafts from the `grammar` source

In the verifier the mask is computed on a worker thread beside the forward, so it costs wall time
only where it is longer than the forward; `echospec bench --workloads workloads/structured_json.jsonl`
measures that end to end, speculation off against on.

Usage:
    .venv/bin/python bench/grammar_mask.py [--workloads F] [--model M.gguf] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=str(ROOT / "workloads" / "structured_json.jsonl"))
    ap.add_argument("--model", help="GGUF file (default SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=0, help="override each workload's max_tokens")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    from echospec.services.text import grammar
    from echospec.services.text.chat_template import ChatTemplate
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.verifier.engine import Model, simd_name

    model = a.model
    if model is None:
        model = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_model.py")], check=True,
                               capture_output=True, text=True).stdout.strip()
    if not Path(model).is_file() or not Path(a.workloads).is_file():
        print(f"grammar_mask: {model if not Path(model).is_file() else a.workloads}: no such file",
              file=sys.stderr)
        return 2
    tok = Tokenizer.from_gguf(model)
    template = ChatTemplate.from_gguf(model)
    workloads = [json.loads(x) for x in Path(a.workloads).read_text().splitlines() if x.strip()]
    workloads = [w for w in workloads if w.get("grammar")]
    rows, all_mask, all_argmax, all_t = [], [], [], []
    with Model(model) as m:
        llg_tok = grammar.TokenizerCache(tok.hf.to_str(), m.info.n_vocab).get(tok.eos_ids)
        for w in workloads:
            kind, src = next(iter(w["grammar"].items()))
            text = json.dumps(src) if kind == "json_schema" and not isinstance(src, str) else src
            spec = grammar.GrammarSpec(kind, "" if kind == "json_object" else text)
            c = grammar.Constraint(llg_tok, spec, m.info.n_vocab)
            prompt = (template.render(w["messages"], add_generation_prompt=True)
                      if "messages" in w else w["prompt"])
            ids = tok.encode(prompt)
            mask_ms, argmax_ms, t_ms, forced = [], [], [], 0
            with m.new_session(n_ctx=len(ids) + 512, n_threads=a.threads) as s:
                _, row = s.prefill(ids, logits=True)
                for _ in range(a.max_tokens or w.get("max_tokens", 256)):
                    forced += bool(c.forced(1))
                    t0 = time.perf_counter()
                    allowed = c.allowed()
                    t1 = time.perf_counter()
                    t = grammar.masked_argmax(row[-1], allowed)
                    t2 = time.perf_counter()
                    mask_ms.append((t1 - t0) * 1e3)
                    argmax_ms.append((t2 - t1) * 1e3)
                    if t in tok.eos_ids:
                        break
                    c.consume([t])
                    t3 = time.perf_counter()
                    _, row = s.forward([t], logits="last")
                    t_ms.append((time.perf_counter() - t3) * 1e3)
            n = len(mask_ms)
            r = {"id": w["id"], "tokens": n, "mask_ms": statistics.median(mask_ms),
                 "argmax_ms": statistics.median(argmax_ms), "T_ms": statistics.median(t_ms),
                 "forced": forced / n}
            r["share"] = (r["mask_ms"] + r["argmax_ms"]) / r["T_ms"]
            rows.append(r)
            all_mask += mask_ms
            all_argmax += argmax_ms
            all_t += t_ms
            print(f"[grammar_mask] {w['id']}: {n} tokens, mask {r['mask_ms']:.3f} ms, T {r['T_ms']:.2f} ms",
                  file=sys.stderr, flush=True)
    total = {"tokens": len(all_mask), "mask_ms": statistics.median(all_mask),
             "argmax_ms": statistics.median(all_argmax), "T_ms": statistics.median(all_t),
             "forced": sum(r["forced"] * r["tokens"] for r in rows) / max(1, len(all_mask))}
    total["share"] = (total["mask_ms"] + total["argmax_ms"]) / total["T_ms"]
    out = {"simd": simd_name(), "threads": a.threads, "model": Path(model).name, "workloads": rows,
           "total": total}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{'workload':<12} {'tokens':>6} {'mask ms':>8} {'argmax ms':>9} {'T ms':>7} {'share':>7} {'forced':>7}")
    for r in rows + [{"id": "all", **total}]:
        print(f"{r['id']:<12} {r['tokens']:>6} {r['mask_ms']:>8.3f} {r['argmax_ms']:>9.3f} {r['T_ms']:>7.2f} "
              f"{100 * r['share']:>6.1f}% {100 * r['forced']:>6.1f}%")
    print(f"engine {out['simd']}, {a.threads} threads, {out['model']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
