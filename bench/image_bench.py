"""Image benchmarks: a Qwen3-VL model served with its projector (any --model / --mmproj pair).

What it measures (greedy; the stack runs in this process, start_stack, prefix cache on):

    ttft        time to first token with an image. Turn 1: one rendered image and a short
                question, streamed (Generate), spec off: TTFT = the first token's arrival - the
                request's start (the image decoded, encoded, the prompt prefilled). Turn 2: the
                same chat one turn later (turn 1's message, its answer, a new question), so the
                prefix cache (which keys an image's tokens by the sha256 of its pixels) gives
                back turn 1's prompt KV image included, and only the new text is prefilled.
                ratio = turn 2's TTFT / turn 1's (goal <= 0.10). Each round renders a new image
                (seed + round), so a turn 1 never meets a cached image; --rounds rounds, medians,
                with the prompt token counts and turn 2's cached_prompt_tokens (the reused prefix).
    workloads   rendered images with a task each (text to transcribe, a table to read, drawn
                objects to describe and list), written as PNGs beside a JSONL whose lines carry
                them in an ``image`` field, run by ``echospec bench --target`` against the same
                stack: each workload spec off and on, alternated --repeat times; tries, hits
                (accepted drafts), the time ratio off / on (> 1: speculation faster) and whether
                the outputs are byte-identical.

The images come from a seed (Pillow's drawing and its default font: the same pixels for the same
seed and Pillow version); nothing is committed but this script.

Usage:
    .venv/bin/python bench/image_bench.py                   # the tiny fixture, a table
    .venv/bin/python bench/image_bench.py --model M.gguf --mmproj P.gguf --json
    .venv/bin/python bench/image_bench.py --quick --json    # a sanity run in seconds (the smoke test's)
    .venv/bin/python bench/image_bench.py --write-workloads DIR   # the PNGs and DIR/images.jsonl, no run
Progress goes to stderr. Times are ms unless the key says otherwise.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in the services' entry points

import argparse
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "models"
MODEL = FIXTURE / "qwen3vl-Q8_0.gguf"
MMPROJ = FIXTURE / "qwen3vl-mmproj-F16.gguf"

WORDS = ("kestrel river mill stone falcon field harbour lantern copper meadow orchard signal "
         "window ledger quarry timber basket violet thunder pepper marble").split()
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220),
           "orange": (240, 150, 30), "purple": (140, 60, 180), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
TURN1 = "What is in this image? Answer in one sentence."
TURN2 = "What colour is the background?"


def log(msg: str) -> None:
    print(f"[image_bench] {msg}", file=sys.stderr, flush=True)


# ---- images, from a seed ------------------------------------------------------------------------

def _font(size: int):
    from PIL import ImageFont
    return ImageFont.load_default(size=size)


def render_text(seed: int, width: int = 448, height: int = 160) -> tuple[bytes, str]:
    """Four lines of words, black on white. Returns (PNG bytes, the text drawn)."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(4)]
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        d.text((12, 10 + i * 36), line, fill="black", font=_font(26))
    return _png(img), "\n".join(lines)


def render_table(seed: int, width: int = 384, height: int = 256) -> tuple[bytes, str]:
    """A 4-row, 3-column table with a header row, drawn with grid lines. Returns (PNG, its text as
    rows of cells separated by " | ")."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    rows = [["item", "count", "price"]]
    rows += [[rng.choice(WORDS), str(rng.randrange(1, 100)), f"{rng.randrange(100, 9999) / 100:.2f}"]
             for _ in range(4)]
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    cw, rh = width // 3, height // len(rows)
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            d.rectangle((c * cw, r * rh, (c + 1) * cw - 1, (r + 1) * rh - 1), outline="black", width=2)
            d.text((c * cw + 10, r * rh + 12), cell, fill="black", font=_font(22))
    return _png(img), "\n".join(" | ".join(row) for row in rows)


def render_objects(seed: int, width: int = 320, height: int = 320) -> tuple[bytes, str]:
    """Three to five filled shapes (circle, square, triangle) of named colours on a light grey
    background, each in its own cell of a 3 x 3 grid. Returns (PNG, "colour shape" per line)."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    img = Image.new("RGB", (width, height), (235, 235, 235))
    d = ImageDraw.Draw(img)
    cells = rng.sample(range(9), rng.randrange(3, 6))
    cw, ch = width // 3, height // 3
    m = min(cw, ch) // 8   # the margin inside a cell
    names = []
    for cell in cells:
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        x0, y0 = (cell % 3) * cw + m, (cell // 3) * ch + m
        x1, y1 = x0 + cw - 2 * m, y0 + ch - 2 * m
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            d.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            d.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
        names.append(f"{colour} {shape}")
    return _png(img), "\n".join(names)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


RENDERERS = {"text": render_text, "table": render_table, "objects": render_objects}

# the workloads: (id, renderer, seed, the user's text); kind is "image_" + the renderer
WORKLOADS = (
    ("image_text", "text", 11, "Transcribe the text in this image."),
    ("image_table", "table", 12, "Read this table: give each row as its cells separated by ' | '."),
    ("image_objects", "objects", 13, "Describe this image, then list the objects in it, one per line."),
)


def write_workloads(out: Path, max_tokens: int) -> Path:
    """The workload images (PNG) and ``out/images.jsonl``, one line per workload with its image
    file in the ``image`` field (relative to the JSONL). Returns the JSONL's path."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for wid, kind, seed, question in WORKLOADS:
        png, _ = RENDERERS[kind](seed)
        (out / f"{wid}.png").write_bytes(png)
        lines.append(json.dumps({"id": wid, "kind": f"image_{kind}", "max_tokens": max_tokens,
                                 "image": f"{wid}.png",
                                 "messages": [{"role": "user", "content": question}]}))
    path = out / "images.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- TTFT ---------------------------------------------------------------------------------------

def _image_msg(png: bytes, text: str):
    from echospec.v1 import coordinator_pb2 as cpb
    return cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png, media_type="image/png"),
                                               cpb.ContentPart(text=text)])


def stream(stub, messages, max_tokens: int) -> dict:
    """One streamed greedy generation, spec off: TTFT (ms), the result."""
    from echospec.v1 import common_pb2, coordinator_pb2 as cpb
    t0 = time.perf_counter()
    first, result = None, None
    for msg in stub.Generate(cpb.GenerateRequest(messages=messages, max_tokens=max_tokens,
                                                 spec=common_pb2.SPEC_MODE_OFF, temperature=0.0),
                             timeout=1800):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        if msg.HasField("result"):
            result = msg.result
    if first is None:
        raise RuntimeError("the generation streamed no token")
    return {"ttft_ms": (first - t0) * 1e3, "result": result}


def ttft(stub, args) -> dict:
    from echospec.v1 import coordinator_pb2 as cpb
    stream(stub, [_image_msg(render_objects(args.seed - 1, *args.ttft_size)[0], TURN1)], 2)   # warm-up, untimed
    rounds = []
    for r in range(args.rounds):
        png, _ = render_objects(args.seed + r, *args.ttft_size)
        t1 = stream(stub, [_image_msg(png, TURN1)], args.answer_tokens)
        msgs = [_image_msg(png, TURN1), cpb.ChatMessage(role="assistant", content=t1["result"].text),
                cpb.ChatMessage(role="user", content=TURN2)]
        t2 = stream(stub, msgs, args.answer_tokens)
        r1, r2 = t1["result"], t2["result"]
        rounds.append({"turn1_ttft_ms": round(t1["ttft_ms"], 2), "turn2_ttft_ms": round(t2["ttft_ms"], 2),
                       "ratio": round(t2["ttft_ms"] / t1["ttft_ms"], 4),
                       "turn1_prompt_tokens": r1.prompt_tokens, "turn2_prompt_tokens": r2.prompt_tokens,
                       "turn1_cached_prompt_tokens": r1.stats.cached_prompt_tokens,
                       "turn2_cached_prompt_tokens": r2.stats.cached_prompt_tokens,
                       "turn1_prefill_ms": round(r1.stats.prefill_ms, 2),
                       "turn2_prefill_ms": round(r2.stats.prefill_ms, 2)})
        log(f"ttft round {r}: turn 1 {t1['ttft_ms']:.1f} ms ({r1.prompt_tokens} tokens), turn 2 "
            f"{t2['ttft_ms']:.1f} ms ({r2.prompt_tokens} tokens, {r2.stats.cached_prompt_tokens} reused)")

    def med(key: str) -> float:
        return round(statistics.median(x[key] for x in rounds), 4)
    out = {key: med(key) for key in rounds[0]}
    out["ratio_median"] = out.pop("ratio")
    out["goal_ratio_le_0.10"] = out["ratio_median"] <= 0.10
    out["image"] = f"objects, {args.ttft_size[0]}x{args.ttft_size[1]}"
    out["rounds"] = rounds
    return out


# ---- workloads: echospec bench --------------------------------------------------------------------

def workloads(target: str, args, out_dir: Path) -> dict:
    jsonl = write_workloads(out_dir, args.max_tokens)
    cmd = [sys.executable, "-m", "echospec.cli", "bench", "--target", target, "--workloads", str(jsonl),
           "--repeat", str(args.repeat), "--json"]
    if args.k:
        cmd += ["--k", str(args.k)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if r.returncode not in (0, 1):   # 1: some output differed, which the rows say
        raise RuntimeError(f"echospec bench failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    rows = []
    for line in r.stdout.splitlines():
        row = json.loads(line)
        off, on = row["off"], row["on"]
        rows.append({"id": row["id"], "kind": row["kind"], "identical": row["identical"],
                     "tokens": on["tokens"], "off_s": off["seconds"], "on_s": on["seconds"],
                     "off_over_on": round(off["seconds"] / on["seconds"], 3) if on["seconds"] > 0 else None,
                     "tries": on["tries"], "hits": on["hits"], "draft_tokens": on["draft_tokens"],
                     "kv_rolls": on["kv_rolls"], "spec_enabled": on["spec_enabled"],
                     "spec_reason": on["spec_reason"], "off_prefill_ms": off["prefill_ms"],
                     "on_prefill_ms": on["prefill_ms"]})
    t_off = sum(x["off_s"] for x in rows)
    t_on = sum(x["on_s"] for x in rows)
    return {"rows": rows, "repeat": args.repeat, "max_tokens": args.max_tokens,
            "total_off_over_on": round(t_off / t_on, 3) if t_on > 0 else None,
            "identical": sum(x["identical"] for x in rows), "of": len(rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL), help="a Qwen3-VL GGUF (default: the tiny fixture)")
    ap.add_argument("--mmproj", default=str(MMPROJ), help="its vision projector GGUF (default: the fixture's)")
    ap.add_argument("--chat-template", default="", help="a Jinja chat template file (default: the model's)")
    ap.add_argument("--threads", type=int, default=0,
                    help="engine threads of a forward over one session (0: the verifier's default)")
    ap.add_argument("--batch-threads", type=int, default=0,
                    help="engine threads of a prefill chunk or a batch (0: the verifier's default)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=None, help="TTFT rounds (default 5)")
    ap.add_argument("--answer-tokens", type=int, default=None, help="tokens of each TTFT turn (default 16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per workload generation (default 128)")
    ap.add_argument("--repeat", type=int, default=None, help="off/on pairs per workload (default 3)")
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: the server's default)")
    ap.add_argument("--seed", type=int, default=100, help="the TTFT images' first seed")
    ap.add_argument("--ttft-size", default="320x320", metavar="WxH",
                    help="the TTFT image's size in pixels (default 320x320: 100 image tokens at patch 16, merge 2)")
    ap.add_argument("--only", choices=("ttft", "workloads"), default=None, help="run one part")
    ap.add_argument("--write-workloads", metavar="DIR", default="",
                    help="write the workload PNGs and DIR/images.jsonl, run nothing")
    ap.add_argument("--quick", action="store_true",
                    help="a sanity run: --rounds 1 --answer-tokens 4 --max-tokens 8 --repeat 1 "
                         "(flags given explicitly keep their values)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    defaults = dict(rounds=5, answer_tokens=16, max_tokens=128, repeat=3)
    if args.quick:
        defaults.update(rounds=1, answer_tokens=4, max_tokens=8, repeat=1)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag, least in (("threads", 0), ("batch_threads", 0), ("n_ctx", 1), ("rounds", 1),
                        ("answer_tokens", 1), ("max_tokens", 1), ("repeat", 1), ("k", 0)):
        if getattr(args, flag) < least:
            ap.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    try:
        args.ttft_size = tuple(int(x) for x in args.ttft_size.lower().split("x"))
        assert len(args.ttft_size) == 2 and min(args.ttft_size) >= 32
    except (ValueError, AssertionError):
        ap.error(f"--ttft-size must be WxH, both >= 32, got {args.ttft_size!r}")
    if args.write_workloads:
        print(write_workloads(Path(args.write_workloads), args.max_tokens))
        return 0
    for flag in ("model", "mmproj", "chat_template"):
        v = getattr(args, flag)
        if v and not Path(v).is_file():
            ap.error(f"--{flag.replace('_', '-')} {v}: no such file")

    import grpc
    from echospec.stack import StackError

    try:
        out = run(args)
    except (StackError, RuntimeError, grpc.RpcError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"image_bench: {detail}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
        return 0
    print_table(out)
    return 0


def run(args) -> dict:
    """Both parts (or --only's) on stacks of args.model + args.mmproj; the JSON object."""
    import grpc
    from echospec.services.verifier.engine import simd_name
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    out = {"model": Path(args.model).name, "mmproj": Path(args.mmproj).name, "simd": simd_name(),
           "threads": args.threads, "batch_threads": args.batch_threads, "cores": os.cpu_count(),
           "load_avg_start": os.getloadavg()[0]}

    def stack(prefix_cache: bool):
        return start_stack(args.model, mmproj=args.mmproj, chat_template=args.chat_template, n_ctx=args.n_ctx,
                           n_threads=args.threads, batch_threads=args.batch_threads,
                           prefix_cache=prefix_cache, spec=False)
    if args.only in (None, "ttft"):
        log("ttft: turn 1 (image + question) and turn 2 (the same chat, the image's KV reused)")
        st = stack(True)
        ch = grpc.insecure_channel(st.target)
        try:
            out["ttft"] = ttft(coordinator_pb2_grpc.CoordinatorServiceStub(ch), args)
        finally:
            ch.close()
            st.stop(0.5)
    if args.only in (None, "workloads"):
        log("workloads: echospec bench, spec off vs on (prefix cache off: every run prefills alike)")
        st = stack(False)
        try:
            with tempfile.TemporaryDirectory() as td:
                out["workloads"] = workloads(st.target, args, Path(td))
        finally:
            st.stop(0.5)
    out["load_avg_end"] = os.getloadavg()[0]
    return out


def print_table(out: dict) -> None:
    print(f"model {out['model']} + {out['mmproj']}, SIMD {out['simd']}, threads "
          f"{out['threads'] or 'default'} of {out['cores']} cores, load {out['load_avg_start']:.2f}"
          f" -> {out['load_avg_end']:.2f}")
    if "ttft" in out:
        t = out["ttft"]
        print(f"TTFT, {len(t['rounds'])} rounds (medians): turn 1 {t['turn1_ttft_ms']} ms "
              f"({t['turn1_prompt_tokens']:.0f} prompt tokens), turn 2 {t['turn2_ttft_ms']} ms "
              f"({t['turn2_prompt_tokens']:.0f} prompt tokens, {t['turn2_cached_prompt_tokens']:.0f} reused); "
              f"turn 2 / turn 1 {t['ratio_median']} (goal <= 0.10: {'met' if t['goal_ratio_le_0.10'] else 'NOT met'})")
    if "workloads" in out:
        w = out["workloads"]
        hdr = (f"{'workload':<14} {'tokens':>6} {'off s':>7} {'on s':>7} {'off/on':>6} {'tries':>5} "
               f"{'hits':>5} {'drafted':>7} {'identical':>9}")
        print(hdr)
        print("-" * len(hdr))
        for x in w["rows"]:
            print(f"{x['id']:<14} {x['tokens']:>6} {x['off_s']:>7.3f} {x['on_s']:>7.3f} "
                  f"{x['off_over_on'] or 0:>6.2f} {x['tries']:>5} {x['hits']:>5} {x['draft_tokens']:>7} "
                  f"{'yes' if x['identical'] else 'NO':>9}")
        print(f"total off / on {w['total_off_over_on']} (> 1: speculation faster); identical "
              f"{w['identical']}/{w['of']}")


if __name__ == "__main__":
    sys.exit(main())
