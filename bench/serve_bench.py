"""Serving benchmark: the whole stack (coordinator -> verifier -> engine) under concurrent clients.

What it measures (greedy, speculation off unless said otherwise):

    concurrency     for batch_max 1 and 8 (a fresh stack each, prefix cache off so every
                    request prefills): 1, 2, 4, 8 clients at once, each streaming one
                    generation of a distinct prompt. aggregate_tok_s = output tokens of all
                    clients / wall time of the level; ttft_ms = time to the first streamed
                    token, per client (p50, max); identical = every client's output equals
                    the same prompt's output run alone (the 1-client level runs the 8
                    prompts one at a time: the baseline of "one at a time").
    paired          the goal figure, robust to a shared host's drifting load: two stacks
                    (batch_max 1 and 8, prefix cache off) in this process; --pairs times, in
                    alternating order, the 8 prompts one at a time on the first and all 8 at
                    once on the second, seconds apart. ratio = 8-at-once tok/s / one-at-a-time
                    tok/s of the same pair; median_ratio over the pairs (0 pairs: skipped).
                    Before the pairs one untimed round of each side (and of the engine's
                    all-at-once side) warms the stacks (--no-pair-warmup: none).
                    Each pair also runs the same work on the engine alone (engine_pairs: the
                    prompts one at a time, prefill then a forward per token, against all of
                    them at once, one es_forward_batch per step), on the batch_max 8 stack's
                    own loaded model and threads: engine_median_ratio is the most the stack
                    could reach at that minute, stack_share = median_ratio / engine_median_ratio.
    plain decode    the stack's greedy decode rate against the engine's own on the same
                    prompt, threads and loaded model, in the same run, alternated over --rounds
                    rounds (the engine is driven in this process through services.verifier.engine,
                    prefill then one forward per token; the stack's rate is (tokens - 1) /
                    (time of the last token - the verifier's prefill time), request setup and
                    the first token's trip included). ratio = median of the
                    per-round stack / engine ratios.
    overhead        the stack's round overhead (stats.overhead_ms: a round's wall time in the
                    verifier's loop minus its forward) against T (stats.t_ms), from the
                    plain decode runs.
    prefix          a ~--long-tokens prompt sent twice to a stack with the prefix cache on
                    (max_tokens 1): the first and second TTFT, their ratio and the second's
                    cached_prompt_tokens.

Usage:
    .venv/bin/python bench/serve_bench.py                 # SmolLM2 (fetched on first use), a table
    .venv/bin/python bench/serve_bench.py --json          # one JSON object on stdout
    .venv/bin/python bench/serve_bench.py --model tiny --quick    # a sanity run in seconds
Progress goes to stderr. All times are ms unless the key says otherwise.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in the services' entry points

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.stack import start_stack  # noqa: E402

OFF = common_pb2.SPEC_MODE_OFF
WORDS = ("the river runs past the old stone mill where a kestrel hunts over blue fields and "
         "one two three children count the falcons while code lists grow in the red house").split()


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _model_path(name: str, tmp: Path) -> str:
    if name == "tiny":
        from ggufgen import write_tiny_model
        p = tmp / "tiny-llama.gguf"
        write_tiny_model(p, arch="llama", n_vocab=320, n_ctx_train=2048, seed=0)
        return str(p)
    if name:
        return name
    return subprocess.check_output([sys.executable, str(ROOT / "scripts" / "fetch_model.py")],
                                   text=True).strip().splitlines()[-1]


def _prompt_ids(stub, seed: int, n_words: int, n_vocab: int) -> list[int]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    ids = list(stub.Tokenize(cpb.TokenizeRequest(text=text)).token_ids)
    return ids or [rng.randrange(3, n_vocab) for _ in range(n_words)]


def in_threads(n: int, fn) -> list:
    """fn(0), ..., fn(n - 1), each on its own thread, all at once; their results in order."""
    runs: list = [None] * n

    def one(i: int) -> None:
        runs[i] = fn(i)
    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return runs


def stream_one(stub, ids: list[int], max_tokens: int) -> dict:
    """One streamed generation: output ids, TTFT, the last token's time, the result's stats."""
    t0 = time.perf_counter()
    first = last = None
    result = None
    for msg in stub.Generate(cpb.GenerateRequest(token_ids=ids, max_tokens=max_tokens, spec=OFF,
                                                 temperature=0.0), timeout=1800):
        now = time.perf_counter()
        if msg.token_ids:
            first = now if first is None else first
            last = now
        if msg.HasField("result"):
            result = msg.result
    # decode time: up to the last token, minus the verifier's prefill (not from the first token's
    # arrival, which a late first message would shift)
    decode_s = (last - t0) - result.stats.prefill_ms / 1e3 if last is not None else 0.0
    return {"ids": list(result.token_ids), "ttft_ms": ((first or time.perf_counter()) - t0) * 1e3,
            "decode_s": decode_s,
            "stats": result.stats, "wall_s": time.perf_counter() - t0}


def concurrency(path: str, args, batch_max: int) -> dict:
    st = start_stack(path, n_ctx=args.n_ctx, n_threads=args.threads, batch_threads=args.batch_threads,
                     batch_max=batch_max,
                     prefix_cache=False, max_tokens=args.max_tokens)
    ch = grpc.insecure_channel(st.target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    try:
        n_vocab = stub.GetInfo(cpb.GetInfoRequest()).n_vocab
        prompts = [_prompt_ids(stub, 100 + i, args.prompt_words, n_vocab) for i in range(max(args.clients))]
        stream_one(stub, prompts[0], 8)  # warm the channel and the engine
        levels = {}
        alone: dict[int, list[int]] = {}
        for n in args.clients:
            t0 = time.perf_counter()
            if n == 1:  # one at a time: every prompt alone, in turn
                runs = [stream_one(stub, p, args.max_tokens) for p in prompts]
            else:
                runs = in_threads(n, lambda i: stream_one(stub, prompts[i], args.max_tokens))
            wall = time.perf_counter() - t0
            for i, r in enumerate(runs):
                alone.setdefault(i, r["ids"])
            toks = sum(len(r["ids"]) for r in runs)
            ttft = [r["ttft_ms"] for r in runs]
            levels[str(n)] = {"clients": n, "aggregate_tok_s": round(toks / wall, 2), "tokens": toks,
                              "seconds": round(wall, 3), "ttft_ms_p50": round(_pct(ttft, 0.5), 2),
                              "ttft_ms_max": round(max(ttft), 2),
                              "identical": all(r["ids"] == alone[i] for i, r in enumerate(runs))}
            log(f"batch_max {batch_max}, {n} clients: {levels[str(n)]['aggregate_tok_s']} tok/s, "
                f"TTFT p50 {levels[str(n)]['ttft_ms_p50']} ms")
        base = levels.get("1", {}).get("aggregate_tok_s") or 0.0
        for lv in levels.values():
            lv["vs_one_at_a_time"] = round(lv["aggregate_tok_s"] / base, 3) if base else None
        return levels
    finally:
        ch.close()
        st.stop()


def paired(path: str, args) -> dict:
    n = max(args.clients)
    stacks = {b: start_stack(path, n_ctx=args.n_ctx, n_threads=args.threads, batch_threads=args.batch_threads,
                             batch_max=b,
                             prefix_cache=False, max_tokens=args.max_tokens) for b in (1, n)}
    chans = {b: grpc.insecure_channel(st.target) for b, st in stacks.items()}
    stubs = {b: coordinator_pb2_grpc.CoordinatorServiceStub(ch) for b, ch in chans.items()}
    try:
        n_vocab = stubs[1].GetInfo(cpb.GetInfoRequest()).n_vocab
        prompts = [_prompt_ids(stubs[1], 100 + i, args.prompt_words, n_vocab) for i in range(n)]
        for b in stubs:
            stream_one(stubs[b], prompts[0], 8)

        def one_at_a_time():
            return [stream_one(stubs[1], p, args.max_tokens) for p in prompts]

        def at_once():
            return in_threads(n, lambda i: stream_one(stubs[n], prompts[i], args.max_tokens))

        core = stacks[n].verifier.core
        eng = EngineBatch(core.model, core.config.n_threads, core.config.batch_threads, args.n_ctx)
        if args.pair_warmup:   # one untimed round of each side: the first all-at-once round on a
            one_at_a_time()    # fresh stack pays its sessions' first-touch page faults
            at_once()
            eng.rate(prompts, [args.max_tokens] * n, at_once=True)
        pairs, eng_pairs = [], []
        for k in range(args.pairs):
            got = {}
            for f in ((one_at_a_time, at_once) if k % 2 == 0 else (at_once, one_at_a_time)):
                t0 = time.perf_counter()
                runs = f()
                got[f.__name__] = (runs, sum(len(r["ids"]) for r in runs) / (time.perf_counter() - t0))
            (ra, sa), (rb, sb) = got["one_at_a_time"], got["at_once"]
            pairs.append({"one_at_a_time_tok_s": round(sa, 2), "at_once_tok_s": round(sb, 2),
                          "ratio": round(sb / sa, 3),
                          "identical": all(a["ids"] == b["ids"] for a, b in zip(ra, rb))})
            lens = [max(1, len(r["ids"])) for r in rb]
            e = {}
            for mode in (("one", "all") if k % 2 == 0 else ("all", "one")):
                e[mode] = eng.rate(prompts, lens, at_once=mode == "all")
            eng_pairs.append({"one_at_a_time_tok_s": round(e["one"], 2), "at_once_tok_s": round(e["all"], 2),
                              "ratio": round(e["all"] / e["one"], 3)})
            log(f"pair {k}: {n} at once {sb:.1f} tok/s, one at a time {sa:.1f} tok/s, ratio {sb / sa:.2f}"
                f" (engine alone {e['all'] / e['one']:.2f})")
        med = statistics.median(p["ratio"] for p in pairs)
        eng_med = statistics.median(p["ratio"] for p in eng_pairs)
        return {"clients": n, "batch_max": n, "threads": core.config.n_threads, "warmup": args.pair_warmup,
                "batch_threads": core.config.batch_threads,
                "iterations_by_threads": {str(k): v for k, v in sorted(core.scheduler.threads_used.items())},
                "pairs": pairs, "median_ratio": round(med, 3),
                "engine_pairs": eng_pairs, "engine_median_ratio": round(eng_med, 3),
                "stack_share": round(med / eng_med, 3)}
    finally:
        for ch in chans.values():
            ch.close()
        for st in stacks.values():
            st.stop()


class EngineDecoder:
    """The engine's own greedy decode in this process (services.verifier.engine).

    Args:
        model: a loaded Model; the stack's own verifier model, so both sides read the
            same weights from the same memory (a second copy can land on other pages,
            e.g. without huge pages, and decode at another speed).
    """

    def __init__(self, model, threads: int, n_ctx: int):
        self.model = model
        self.threads, self.n_ctx = threads, n_ctx

    def rate(self, ids: list[int], n_tokens: int) -> float:
        """Tokens / s of n_tokens - 1 decode steps after prefilling ``ids`` (one forward per token)."""
        s = self.model.new_session(n_ctx=self.n_ctx, n_threads=self.threads)
        try:
            tok, _ = s.prefill(ids)
            t0 = time.perf_counter()
            for _ in range(n_tokens - 1):
                am, _ = s.forward([tok])
                tok = int(am[0])
            return (n_tokens - 1) / (time.perf_counter() - t0)
        finally:
            s.close()


class EngineBatch:
    """The paired figure's work on the engine alone (services.verifier.engine, in this process).

    Args:
        model: the stack's own loaded Model (see EngineDecoder). threads, batch_threads, n_ctx:
            as the stack's verifier (a forward over one session on ``threads``, one over two
            or more on ``batch_threads``, as its scheduler does).
    """

    def __init__(self, model, threads: int, batch_threads: int, n_ctx: int):
        self.model, self.threads, self.batch_threads, self.n_ctx = model, threads, batch_threads, n_ctx

    def rate(self, prompts: list[list[int]], lens: list[int], at_once: bool) -> float:
        """Tokens / s of greedy generations of lens[i] tokens from prompts[i]: one after another
        (prefill, then a forward per token), or all at once (the prefills in one es_forward_batch,
        then one es_forward_batch per step over the sessions still generating)."""
        from echospec.services.verifier.engine import forward_batch
        ss = [self.model.new_session(n_ctx=self.n_ctx, n_threads=max(self.threads, self.batch_threads))
              for _ in prompts]
        try:
            for s in ss:
                s.threads = self.threads
            t0 = time.perf_counter()
            if not at_once:
                for s, p, n in zip(ss, prompts, lens):
                    tok, _ = s.prefill(p)
                    for _ in range(n - 1):
                        am, _ = s.forward([tok])
                        tok = int(am[0])
            else:
                ss[0].threads = self.batch_threads if len(ss) > 1 else self.threads
                res = forward_batch([(s, p, "last", "none") for s, p in zip(ss, prompts)])
                toks = [int(r[0][0]) for r in res]
                for step in range(1, max(lens)):
                    live = [i for i, n in enumerate(lens) if step < n]
                    ss[live[0]].threads = self.batch_threads if len(live) > 1 else self.threads
                    res = forward_batch([(ss[i], [toks[i]], "all", "none") for i in live])
                    for i, r in zip(live, res):
                        toks[i] = int(r[0][0])
            return sum(lens) / (time.perf_counter() - t0)
        finally:
            for s in ss:
                s.close()


def plain_decode(path: str, args) -> dict:
    st = start_stack(path, n_ctx=args.n_ctx, n_threads=args.threads, batch_threads=args.batch_threads, prefix_cache=False,
                     max_tokens=args.decode_tokens)
    ch = grpc.insecure_channel(st.target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    try:
        n_vocab = stub.GetInfo(cpb.GetInfoRequest()).n_vocab
        ids = _prompt_ids(stub, 7, args.prompt_words, n_vocab)
        stream_one(stub, ids, args.decode_tokens)     # warm-up of both, untimed
        eng = EngineDecoder(st.verifier.core.model, st.verifier.core.config.n_threads, args.n_ctx)  # the stack's own count
        eng.rate(ids, args.decode_tokens)
        ratios, stack_r, eng_r, over, t_ms = [], [], [], [], []
        for rnd in range(args.rounds):
            got = {}
            for who in (("stack", "engine") if rnd % 2 == 0 else ("engine", "stack")):
                if who == "stack":
                    r = stream_one(stub, ids, args.decode_tokens)
                    n = len(r["ids"])
                    got["stack"] = (n - 1) / r["decode_s"] if n > 1 and r["decode_s"] > 0 else 0.0
                    over.append(r["stats"].overhead_ms)
                    t_ms.append(r["stats"].t_ms)
                else:
                    got["engine"] = eng.rate(ids, args.decode_tokens)
            stack_r.append(got["stack"])
            eng_r.append(got["engine"])
            ratios.append(got["stack"] / got["engine"])
        ov, tm = statistics.median(over), statistics.median(t_ms)
        return {"stack_tok_s": round(statistics.median(stack_r), 2),
                "engine_tok_s": round(statistics.median(eng_r), 2),
                "stack_over_engine": round(statistics.median(ratios), 3),
                "overhead_ms": round(ov, 4), "t_ms": round(tm, 4),
                "overhead_share_of_T": round(ov / tm, 4) if tm else None, "rounds": args.rounds,
                "tokens": args.decode_tokens}
    finally:
        ch.close()
        st.stop()


def prefix_reuse(path: str, args) -> dict:
    st = start_stack(path, n_ctx=args.n_ctx, n_threads=args.threads, batch_threads=args.batch_threads, prefix_cache=True)
    ch = grpc.insecure_channel(st.target)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    try:
        n_vocab = stub.GetInfo(cpb.GetInfoRequest()).n_vocab
        stream_one(stub, _prompt_ids(stub, 1, 8, n_vocab), 4)
        ids: list[int] = []
        seed = 900
        while len(ids) < args.long_tokens:
            ids += _prompt_ids(stub, seed, 64, n_vocab)
            seed += 1
        ids = ids[:args.long_tokens]
        first = stream_one(stub, ids, 1)
        second = stream_one(stub, ids, 1)
        return {"prompt_tokens": len(ids), "ttft_first_ms": round(first["ttft_ms"], 2),
                "ttft_second_ms": round(second["ttft_ms"], 2),
                "second_over_first": round(second["ttft_ms"] / first["ttft_ms"], 4),
                "cached_prompt_tokens": second["stats"].cached_prompt_tokens,
                "identical": first["ids"] == second["ids"]}
    finally:
        ch.close()
        st.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF path, 'tiny' (a random tiny model) or empty: SmolLM2")
    ap.add_argument("--threads", type=int, default=0,
                    help="engine threads of a forward over one session (0: the verifier's default, the usable CPUs less one)")
    ap.add_argument("--batch-threads", type=int, default=0,
                    help="engine threads of an iteration over >= 2 sessions or a prefill chunk of >= 16"
                         " tokens (0: the verifier's default, every usable CPU when --threads is 0)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--batch-max", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per client generation (default 64)")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--decode-tokens", type=int, default=None, help="plain decode length (default 128)")
    ap.add_argument("--rounds", type=int, default=None, help="alternated stack/engine decode rounds (default 4)")
    ap.add_argument("--long-tokens", type=int, default=None, help="prefix reuse prompt length (default 1000)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="alternated one-at-a-time / all-at-once pairs (0: skip the paired figure; default 3)")
    ap.add_argument("--pair-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed round of each side before the pairs (--no-pair-warmup: none)")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, a sanity run: --max-tokens 16 --decode-tokens 32 --rounds 2 --long-tokens 300"
                         " --pairs 1 (flags given explicitly keep their values)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    defaults = dict(max_tokens=64, decode_tokens=128, rounds=4, long_tokens=1000, pairs=3)
    if args.quick:
        defaults.update(max_tokens=16, decode_tokens=32, rounds=2, long_tokens=300, pairs=1)
    for name, value in defaults.items():   # explicit flags win over --quick
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag, least in (("threads", 0), ("batch_threads", 0), ("n_ctx", 1), ("max_tokens", 1), ("prompt_words", 1),
                        ("decode_tokens", 1), ("rounds", 1), ("long_tokens", 1), ("pairs", 0)):
        if getattr(args, flag) < least:
            ap.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    for flag in ("clients", "batch_max"):
        raw = getattr(args, flag)
        try:
            ok = all(int(x) >= 1 for x in raw.split(","))
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--{flag.replace('_', '-')} needs comma-separated integers >= 1, got {raw!r}")
    if args.model not in ("", "tiny") and not Path(args.model).is_file():
        ap.error(f"--model {args.model}: no such file (a GGUF path, 'tiny' or empty for SmolLM2)")
    args.clients = [int(x) for x in args.clients.split(",")]
    if 1 not in args.clients:
        args.clients.insert(0, 1)
    with tempfile.TemporaryDirectory() as td:
        path = _model_path(args.model, Path(td))
        from echospec.services.verifier.engine import simd_name
        out = {"model": Path(path).name, "simd": simd_name(), "threads": args.threads,
               "batch_threads": args.batch_threads, "load_avg_start": os.getloadavg()[0],
               "cores": os.cpu_count(), "max_tokens": args.max_tokens}
        out["concurrency"] = {f"batch_max_{bm}": concurrency(path, args, int(bm))
                              for bm in args.batch_max.split(",")}
        if args.pairs > 0:
            log("paired: one at a time vs all at once, alternated")
            out["paired"] = paired(path, args)
        log("plain decode: stack vs engine")
        out["plain_decode"] = plain_decode(path, args)
        log("prefix reuse")
        out["prefix"] = prefix_reuse(path, args)
    out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model {out['model']}, SIMD {out['simd']}, threads {out['threads'] or 'default'} of {out['cores']} cores")
    for bm, levels in out["concurrency"].items():
        for n, lv in levels.items():
            print(f"{bm:12} {n:>2} clients: {lv['aggregate_tok_s']:8.1f} tok/s ({lv['vs_one_at_a_time']}x one at"
                  f" a time), TTFT p50 {lv['ttft_ms_p50']:8.1f} ms max {lv['ttft_ms_max']:8.1f} ms,"
                  f" identical {lv['identical']}")
    if "paired" in out:
        pr = out["paired"]
        print(f"paired: {pr['clients']} clients at once (batch_max {pr['batch_max']}) vs one at a time:"
              f" median {pr['median_ratio']}x over {len(pr['pairs'])} pairs"
              f" ({', '.join(str(p['ratio']) for p in pr['pairs'])}),"
              f" identical {all(p['identical'] for p in pr['pairs'])}; the engine alone"
              f" {pr['engine_median_ratio']}x, the stack's share {pr['stack_share']}")
    pd = out["plain_decode"]
    print(f"plain decode: stack {pd['stack_tok_s']} tok/s, engine {pd['engine_tok_s']} tok/s,"
          f" ratio {pd['stack_over_engine']}; round overhead {pd['overhead_ms']} ms = "
          f"{pd['overhead_share_of_T']} of T {pd['t_ms']} ms")
    px = out["prefix"]
    print(f"prefix: {px['prompt_tokens']}-token prompt, TTFT {px['ttft_first_ms']} ms then"
          f" {px['ttft_second_ms']} ms ({px['second_over_first']}), cached {px['cached_prompt_tokens']},"
          f" identical {px['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
