"""Long context: what sparse attention saves per decode step, and what eviction, sparse attention and
a q8_0 KV cache cost in quality and memory.

Three parts (`--part`, default all):

    speed    On the Qwen3-0.6B shape (random weights, real shapes; bench/qwen3_shapes.py makes the
             file), at depths 2048, 8192 and 16384: T, one decode step, with sparse attention
             (TOPK = 1/8 of the context's 64-position blocks) against dense attention. Two sessions
             hold the same context; samples alternate between them (the host drifts).
    quality  SmolLM2-135M-Instruct on bench/data/long_document.txt (its first 8192 tokens): the
             mean negative log-likelihood per token of dense attention and of each variant, and
             the mean KL(dense || variant) of the next-token distributions, for KV eviction
             (S 4, W 1024), sparse attention (1/8 of the blocks: TOPK 16) and the q8_0 KV cache.
             Sparse attention applies to calls of up to 8 tokens, so its session reads the text
             one token per call, as a generation does; the others read it 256 tokens per call
             (the engine's contract makes that bitwise equal to one token per call).
    memory   A 32768-token greedy generation on SmolLM2 with eviction (S 4, W 1024), in a child
             process: its peak RSS and the engine's KV bytes, against the size of the dense cache
             for the same length.

Usage:
    .venv/bin/python bench/long_context.py                         # all three parts, a table
    .venv/bin/python bench/long_context.py --part speed --depths 2048,8192 --json
    .venv/bin/python bench/long_context.py --part quality --tokens 2048    # a quicker quality run

Progress goes to stderr. Exit status 2 when a model file or the document is missing (the Qwen3
shape is made by `bench/qwen3_shapes.py --shapes 0.6B --types Q4_K_M`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "bench" / "data" / "long_document.txt"
SINKS, WINDOW = 4, 1024
BLOCK = 64


def say(msg: str) -> None:
    print(f"[long_context] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    print(f"long_context: {msg}", file=sys.stderr)
    sys.exit(2)


def smollm2_path() -> str:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        die(f"scripts/fetch_model.py failed: {out.stderr.strip()}")
    return out.stdout.strip()


def qwen3_shape_path() -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    import qwen3_shapes

    p = qwen3_shapes.shape_path(qwen3_shapes.SHAPES["0.6B"], "Q4_K_M", qwen3_shapes.out_dir())
    if not p.exists():
        die(f"{p} is missing: make it with `.venv/bin/python bench/qwen3_shapes.py --shapes 0.6B "
            f"--types Q4_K_M`")
    return p


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def load_avg() -> float:
    return os.getloadavg()[0]


# --- speed -------------------------------------------------------------------------------------

def speed(model_path: Path, depths: list[int], threads: int, samples: int) -> list[dict]:
    """T dense and T sparse at each depth, medians of `samples` alternated decode steps."""
    from echospec.services.verifier.engine import Model

    rows = []
    rng = np.random.default_rng(1234)
    with Model(str(model_path)) as m:
        for depth in depths:
            blocks = depth // BLOCK
            topk = max(1, blocks // 8)
            prompt = rng.integers(0, m.info.n_vocab, size=depth).tolist()
            sessions = {}
            for name, kw in (("dense", {}), ("sparse", {"sparse_topk": topk})):
                s = m.new_session(n_ctx=depth + BLOCK, n_threads=threads, **kw)
                t0 = time.perf_counter()
                for i in range(0, depth, 512):
                    s.prefill(prompt[i:i + 512])
                say(f"depth {depth}: {name} prefilled in {time.perf_counter() - t0:.1f} s")
                sessions[name] = s
            times = {"dense": [], "sparse": []}
            tok = int(prompt[-1])
            for i in range(samples + 2):
                order = ("dense", "sparse") if i % 2 == 0 else ("sparse", "dense")
                for name in order:
                    s = sessions[name]
                    t0 = time.perf_counter()
                    s.forward([tok])
                    dt = (time.perf_counter() - t0) * 1e3
                    s.rollback(depth)
                    if i >= 2:                      # two warm-up rounds
                        times[name].append(dt)
            for s in sessions.values():
                s.close()
            td, ts = statistics.median(times["dense"]), statistics.median(times["sparse"])
            rows.append({"depth": depth, "blocks": blocks, "topk": topk, "T_dense_ms": round(td, 3),
                         "T_sparse_ms": round(ts, 3), "ratio": round(ts / td, 3), "load": round(load_avg(), 2)})
            say(f"depth {depth}: T dense {td:.2f} ms, sparse (TOPK {topk} of {blocks} blocks) {ts:.2f} ms, "
                f"{ts / td:.2f}x")
    return rows


# --- quality -----------------------------------------------------------------------------------

def quality(model_path: str, n_tokens: int, threads: int) -> dict:
    """NLL of dense and of each variant over the document, and mean KL(dense || variant)."""
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.verifier.engine import Model

    if not DOCUMENT.exists():
        die(f"{DOCUMENT} is missing")
    tok = Tokenizer.from_gguf(model_path)
    ids = tok.encode(DOCUMENT.read_text(encoding="utf-8"))
    if tok.bos_id is not None:
        ids = [tok.bos_id] + ids
    if len(ids) < n_tokens + 1:
        die(f"the document has {len(ids)} tokens, fewer than --tokens {n_tokens} + 1")
    ids = ids[:n_tokens + 1]
    blocks = n_tokens // BLOCK
    topk = max(1, blocks // 8)
    variants = {
        "eviction": {"kv_sinks": SINKS, "kv_window": WINDOW},
        "sparse": {"sparse_topk": topk},
        "q8_0_kv": {"kv_type": "q8_0"},
    }
    chunk = 256
    with Model(model_path) as m:
        dense = m.new_session(n_ctx=n_tokens + BLOCK, n_threads=threads)
        sessions = {}
        for name, kw in variants.items():
            try:
                sessions[name] = m.new_session(n_ctx=n_tokens + BLOCK, n_threads=threads, **kw)
            except TypeError as e:                  # an engine without this option
                say(f"{name}: skipped ({e})")
        nll = {"dense": 0.0, **{k: 0.0 for k in sessions}}
        kld = {k: 0.0 for k in sessions}
        kld_max = {k: 0.0 for k in sessions}
        agree = {k: 0 for k in sessions}
        t0 = time.perf_counter()
        for i in range(0, n_tokens, chunk):
            piece = ids[i:min(i + chunk, n_tokens)]
            target = np.array(ids[i + 1:i + 1 + len(piece)])
            _, lg = dense.forward(piece, logits="all")
            ref = log_softmax(lg)
            rows = np.arange(len(piece))
            nll["dense"] -= ref[rows, target].sum()
            for name, s in sessions.items():
                if name == "sparse":
                    lv = np.concatenate([s.forward([t], logits="all")[1] for t in piece])
                else:
                    lv = s.forward(piece, logits="all")[1]
                lp = log_softmax(lv)
                nll[name] -= lp[rows, target].sum()
                k = (np.exp(ref) * (ref - lp)).sum(axis=-1)
                kld[name] += k.sum()
                kld_max[name] = max(kld_max[name], float(k.max()))
                agree[name] += int((ref.argmax(axis=-1) == lp.argmax(axis=-1)).sum())
            done = i + len(piece)
            say(f"quality: {done}/{n_tokens} tokens, {time.perf_counter() - t0:.0f} s")
        out = {"tokens": n_tokens, "topk": topk, "blocks": blocks, "sinks": SINKS, "window": WINDOW,
               "nll_dense": round(nll["dense"] / n_tokens, 4), "variants": {}}
        for name, s in sessions.items():
            out["variants"][name] = {
                "nll": round(nll[name] / n_tokens, 4),
                "kld_mean": round(kld[name] / n_tokens, 5),
                "kld_max": round(kld_max[name], 4),
                "top1_agree": round(agree[name] / n_tokens, 4),
                "kv_bytes": s.kv_bytes,
            }
            s.close()
        out["kv_bytes_dense"] = dense.kv_bytes
        dense.close()
    return out


# --- memory ------------------------------------------------------------------------------------

def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory_child(model_path: str, n_tokens: int, threads: int) -> dict:
    from echospec.services.verifier.engine import Model

    with Model(model_path) as m:
        info = m.info
        rss_model = _rss_kib("VmRSS")
        with m.new_session(n_ctx=2 * (SINKS + WINDOW) + 2 * BLOCK, n_threads=threads,
                           kv_sinks=SINKS, kv_window=WINDOW) as s:
            tok, done = 1, 0
            t0 = time.perf_counter()
            while done < n_tokens:
                steps = min(2048, n_tokens - done)
                out, _ = s.decode(tok, steps)
                tok = out[-1]
                done += len(out)
                say(f"memory: {done}/{n_tokens} tokens, RSS {_rss_kib('VmRSS') / 1024:.0f} MiB, "
                    f"{time.perf_counter() - t0:.0f} s")
            kv = s.kv_bytes
            n_past = s.n_past
    dense = n_tokens * info.n_layer * 2 * info.n_head_kv * info.head_dim * 2
    return {"tokens": n_tokens, "n_past": n_past, "sinks": SINKS, "window": WINDOW,
            "rss_model_mib": round(rss_model / 1024, 1), "rss_peak_mib": round(_rss_kib("VmHWM") / 1024, 1),
            "kv_bytes_eviction": kv, "kv_bytes_dense": dense,
            "seconds": round(time.perf_counter() - t0, 1)}


def memory(model_path: str, n_tokens: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--part", "memory-child", "--model", model_path,
                          "--memory-tokens", str(n_tokens), "--threads", str(threads)],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        die("the memory child failed (its error is above)")
    return json.loads(out.stdout)


def _ints(arg: str) -> list[int]:
    try:
        vals = [int(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {arg!r}")
    if not vals or any(v < 2 * BLOCK for v in vals):
        raise argparse.ArgumentTypeError(f"each depth must be >= {2 * BLOCK}, got {arg!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "speed", "quality", "memory", "memory-child"), default="all")
    ap.add_argument("--depths", type=_ints, default=[2048, 8192, 16384],
                    help="speed: context depths (default 2048,8192,16384)")
    ap.add_argument("--samples", type=int, default=12, help="speed: timed steps per engine and depth (default 12)")
    ap.add_argument("--tokens", type=int, default=8192, help="quality: document tokens scored (default 8192)")
    ap.add_argument("--memory-tokens", type=int, default=32768,
                    help="memory: tokens generated with eviction (default 32768)")
    ap.add_argument("--model", help="quality and memory: GGUF file (default SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--speed-model", help="speed: GGUF file (default the Qwen3-0.6B shape, Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = ap.parse_args(argv)
    if a.samples < 1 or a.tokens < BLOCK or a.memory_tokens < 1 or a.threads < 1:
        die("--samples, --memory-tokens and --threads must be >= 1, --tokens >= 64")
    for name in ("model", "speed_model"):
        if getattr(a, name) and not Path(getattr(a, name)).is_file():
            die(f"--{name.replace('_', '-')} {getattr(a, name)}: no such file")
    if a.part == "memory-child":
        print(json.dumps(memory_child(a.model, a.memory_tokens, a.threads)))
        return 0
    from echospec.services.verifier.engine import simd_name

    res: dict = {"simd": simd_name(), "threads": a.threads, "load_start": round(load_avg(), 2)}
    small = a.model or (smollm2_path() if a.part in ("all", "quality", "memory") else None)
    if a.part in ("all", "speed"):
        shape = Path(a.speed_model) if a.speed_model else qwen3_shape_path()
        res["speed"] = speed(shape, a.depths, a.threads, a.samples)
    if a.part in ("all", "quality"):
        res["quality"] = quality(small, a.tokens, a.threads)
    if a.part in ("all", "memory"):
        res["memory"] = memory(small, a.memory_tokens, a.threads)
    res["load_end"] = round(load_avg(), 2)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"engine {res['simd']}, {a.threads} threads, load {res['load_start']} -> {res['load_end']}")
    for r in res.get("speed", []):
        print(f"speed  depth {r['depth']:>6}  T dense {r['T_dense_ms']:8.2f} ms  sparse (TOPK {r['topk']:>3} of "
              f"{r['blocks']:>4} blocks) {r['T_sparse_ms']:8.2f} ms  {r['ratio']:.2f}x dense")
    q = res.get("quality")
    if q:
        print(f"quality  {q['tokens']} tokens  NLL dense {q['nll_dense']:.4f}")
        for name, v in q["variants"].items():
            print(f"quality  {name:<9} NLL {v['nll']:.4f}  KLD mean {v['kld_mean']:.5f}  max {v['kld_max']:.3f}  "
                  f"top-1 agree {100 * v['top1_agree']:.2f} %  KV {v['kv_bytes'] / 2**20:.1f} MiB "
                  f"(dense {q['kv_bytes_dense'] / 2**20:.1f} MiB)")
    mm = res.get("memory")
    if mm:
        print(f"memory  {mm['tokens']} tokens with eviction (S {mm['sinks']}, W {mm['window']}): peak RSS "
              f"{mm['rss_peak_mib']:.0f} MiB (model loaded {mm['rss_model_mib']:.0f} MiB), KV "
              f"{mm['kv_bytes_eviction'] / 2**20:.1f} MiB; the dense cache would be "
              f"{mm['kv_bytes_dense'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
