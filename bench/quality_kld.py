"""Quality: how far each engine's next-token distributions are from full-precision weights.

The reference is llama.cpp running an F32 copy of the model (every tensor dequantized by
llama.cpp's own quantize tool, `llama_model_quantize` with the ALL_F32 type). Over each text
(bench/data/kld_prose.txt and kld_code.txt by default), both engines run the quantized file on the
same tokens and this prints, per engine and text:

    kld_mean      mean over positions of KL(reference || engine), in nats
    kld_p99       its 99th percentile
    top1_agree    share of positions whose argmax is the reference's

Goal: ours at most llama.cpp's own KLD on the same quantized file (both read the same weights; the
difference is how each computes with them).

Usage:
    python bench/quality_kld.py --model ~/.cache/echospec/gemma-3-270m-q4_k_m.gguf
    python bench/quality_kld.py --model M.gguf --texts my.txt --json

The F32 copy is written once into the bench cache ($ECHOSPEC_CACHE/bench, else
~/.cache/echospec/bench) and reused. Needs the `bench` extra (llama-cpp-python). Progress goes to
stderr; exit status 2 when the model, a text or llama-cpp-python is unusable.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXTS = [ROOT / "bench" / "data" / "kld_prose.txt", ROOT / "bench" / "data" / "kld_code.txt"]


def say(msg: str) -> None:
    print(f"[quality_kld] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    print(f"quality_kld: {msg}", file=sys.stderr)
    sys.exit(2)


def cache_dir() -> Path:
    base = os.environ.get("ECHOSPEC_CACHE") or str(Path.home() / ".cache" / "echospec")
    d = Path(base) / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def f32_copy(llama_cpp, model: Path) -> Path:
    """The model with every tensor in F32, made by llama.cpp's quantize tool (cached)."""
    st = model.stat()
    out = cache_dir() / f"{model.stem}.{st.st_size}.f32.gguf"
    if out.exists():
        return out
    say(f"writing an F32 copy of {model.name} with llama.cpp's quantize tool -> {out}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(model).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        die(f"llama.cpp could not write an F32 copy of {model} (status {rc})")
    tmp.rename(out)
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def llama_logits(llama_cpp, path: Path, tokens: list[int], threads: int) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens) + 8, n_batch=len(tokens),
                          n_ubatch=len(tokens), n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def our_logits(path: Path, tokens: list[int], threads: int) -> np.ndarray:
    from echospec.services.verifier.engine import Model

    with Model(str(path)) as m:
        with m.new_session(n_ctx=len(tokens) + 64, n_threads=threads) as s:
            _, logits = s.forward(tokens, logits="all")
    return logits


def compare(ref_lp: np.ndarray, logits: np.ndarray) -> dict:
    lp = log_softmax(logits)
    kld = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
    agree = (ref_lp.argmax(axis=-1) == lp.argmax(axis=-1)).mean()
    return {"kld_mean": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)),
            "top1_agree": float(agree)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the quantized GGUF file both engines run")
    ap.add_argument("--texts", default=",".join(str(p) for p in DEFAULT_TEXTS),
                    help="comma-separated text files (default: bench/data/kld_prose.txt, kld_code.txt)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine (default 2)")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens of each text used (default 512)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    model = Path(args.model).expanduser()
    if not model.is_file():
        die(f"model file not found: {model}")
    if not 1 <= args.threads <= 256:
        die(f"--threads {args.threads}: must be in [1, 256]")
    if args.max_tokens < 2:
        die(f"--max-tokens {args.max_tokens}: must be >= 2")
    texts = [Path(t) for t in args.texts.split(",") if t]
    for t in texts:
        if not t.is_file():
            die(f"text file not found: {t}")
    try:
        import llama_cpp
    except ImportError:
        die("llama-cpp-python is not installed (pip install -e '.[bench]'): it runs the reference")
    from echospec.services.text.tokenizer import Tokenizer

    ref_path = f32_copy(llama_cpp, model)
    tok = Tokenizer.from_gguf(str(model))
    out = {"model": str(model), "reference": str(ref_path), "threads": args.threads, "texts": {}}
    for t in texts:
        ids = tok.prompt_ids(t.read_text())[:args.max_tokens]
        say(f"{t.name}: {len(ids)} tokens; reference (llama.cpp, F32) ...")
        t0 = time.monotonic()
        ref_lp = log_softmax(llama_logits(llama_cpp, ref_path, ids, args.threads))
        say(f"  {time.monotonic() - t0:.1f} s; llama.cpp on {model.name} ...")
        peer = compare(ref_lp, llama_logits(llama_cpp, model, ids, args.threads))
        say("  echospec ...")
        ours = compare(ref_lp, our_logits(model, ids, args.threads))
        out["texts"][t.name] = {"tokens": len(ids), "echospec": ours, "llama.cpp": peer,
                                "kld_ratio": ours["kld_mean"] / peer["kld_mean"] if peer["kld_mean"] else None}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"KL(F32 reference || engine) on {model.name}, {args.threads} threads")
    print(f"{'text':<16} {'tokens':>6} {'engine':<10} {'kld_mean':>10} {'kld_p99':>10} {'top1':>7}")
    for name, r in out["texts"].items():
        for eng in ("echospec", "llama.cpp"):
            e = r[eng]
            print(f"{name:<16} {r['tokens']:>6} {eng:<10} {e['kld_mean']:>10.5f} {e['kld_p99']:>10.5f} "
                  f"{e['top1_agree']:>7.3f}")
        print(f"{name:<16} ours / llama.cpp mean KLD: {r['kld_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
