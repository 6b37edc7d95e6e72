"""Quality of the Q8_0 KV cache: how far its next-token distributions are from the F16 cache's.

Both runs are our engine on the same model file and the same tokens (each text's first
--max-tokens tokens, one prefill with every row's logits); only the KV cache type differs. Per
text this prints:

    kld_mean      mean over positions of KL(F16 cache || Q8_0 cache), in nats
    kld_p99       its 99th percentile
    kld_max       the largest
    top1_agree    share of positions whose argmax is the F16 cache's
    kv_mib        the KV cache of each session (F16, Q8_0), MiB, at n_ctx = tokens + 64

Usage:
    python bench/kv_type_kld.py                       # SmolLM2-135M-Instruct Q4_1 (the default model)
    python bench/kv_type_kld.py --model M.gguf --texts my.txt --json

tests/test_kv_type.py checks a bound on the same figures for SmolLM2 (README.md, "KV cache type").
Exit status 2 when the model or a text is unusable.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXTS = [ROOT / "bench" / "data" / "kld_prose.txt", ROOT / "bench" / "data" / "kld_code.txt"]


def die(msg: str) -> None:
    print(f"kv_type_kld: {msg}", file=sys.stderr)
    sys.exit(2)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kv_type_logits(model, tokens: list[int], kv_type: str, threads: int) -> tuple[np.ndarray, int]:
    """Every position's logits [len(tokens), n_vocab] with a KV cache of kv_type, and its bytes."""
    with model.new_session(n_ctx=len(tokens) + 64, n_threads=threads, kv_type=kv_type) as s:
        _, logits = s.forward(tokens, logits="all")
        return logits, s.kv_bytes


def compare(ref_logits: np.ndarray, logits: np.ndarray) -> dict:
    """KL(ref || other) per position (nats) and top-1 agreement.

    Args:
        ref_logits, logits: [n_positions, n_vocab].
    Returns:
        kld_mean, kld_p99, kld_max (nats) and top1_agree (a share in [0, 1]).
    """
    ref_lp, lp = log_softmax(ref_logits), log_softmax(logits)
    kld = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
    agree = (ref_lp.argmax(axis=-1) == lp.argmax(axis=-1)).mean()
    return {"kld_mean": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)),
            "kld_max": float(kld.max()), "top1_agree": float(agree)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1, "
                                                "fetched by scripts/fetch_model.py)")
    ap.add_argument("--texts", default=",".join(str(p) for p in DEFAULT_TEXTS),
                    help="comma-separated text files (default: bench/data/kld_prose.txt, kld_code.txt)")
    ap.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens of each text used (default 512)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.model:
        model_path = Path(args.model).expanduser()
    else:
        sys.path.insert(0, str(ROOT / "scripts"))
        import fetch_model
        model_path = Path(fetch_model.fetch(verbose=False))
    if not model_path.is_file():
        die(f"model file not found: {model_path}")
    if not 1 <= args.threads <= 256:
        die(f"--threads {args.threads}: must be in [1, 256]")
    if args.max_tokens < 2:
        die(f"--max-tokens {args.max_tokens}: must be >= 2")
    texts = [Path(t) for t in args.texts.split(",") if t]
    for t in texts:
        if not t.is_file():
            die(f"text file not found: {t}")
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.verifier.engine import Model, simd_name

    tok = Tokenizer.from_gguf(str(model_path))
    out = {"model": model_path.name, "threads": args.threads, "simd": simd_name(), "texts": {}}
    with Model(str(model_path)) as m:
        for t in texts:
            ids = tok.prompt_ids(t.read_text())[:args.max_tokens]
            ref, ref_bytes = kv_type_logits(m, ids, "f16", args.threads)
            q8, q8_bytes = kv_type_logits(m, ids, "q8_0", args.threads)
            out["texts"][t.name] = {"tokens": len(ids), **compare(ref, q8),
                                    "kv_mib": [ref_bytes / 2 ** 20, q8_bytes / 2 ** 20]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"KL(F16 KV cache || Q8_0 KV cache) on {out['model']}, {args.threads} threads, {out['simd']}")
    print(f"{'text':<16} {'tokens':>6} {'kld_mean':>10} {'kld_p99':>10} {'kld_max':>10} {'top1':>7} "
          f"{'KV MiB f16 / q8_0':>18}")
    for name, r in out["texts"].items():
        print(f"{name:<16} {r['tokens']:>6} {r['kld_mean']:>10.6f} {r['kld_p99']:>10.6f} "
              f"{r['kld_max']:>10.6f} {r['top1_agree']:>7.3f} {r['kv_mib'][0]:>8.2f} / {r['kv_mib'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
