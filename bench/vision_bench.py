"""Vision encoder benchmark: echospec's es_vision_encode against llama.cpp's mtmd, same projector file,
same image, same threads.

What it measures: the time to encode one square image of each --sizes (default 448 and 896 pixels:
784 and 3136 patches of 16, 196 and 784 image tokens) through the whole Qwen3-VL vision tower, the
final merger and the deepstack mergers, in milliseconds. Ours is es_vision_encode (through
echospec.services.verifier.engine.Vision.encode) on already normalised pixels; the peer is
mtmd_encode_chunk on the image chunk of an already tokenized prompt (mtmd_tokenize does its
resizing and normalisation before the clock starts). So both clocks hold the encoder only. Each
engine encodes each size once untimed first (llama.cpp builds its graph and buffers then).

The projector: random weights with the shape of Qwen3-VL-2B-Instruct's vision_config (hidden 1024,
depth 24, 16 heads, intermediate 4096, patch 16, temporal patch 2, spatial merge 2,
out_hidden_size 2048, deepstack_visual_indexes [5, 11, 17], num_position_embeddings 2304), written
with the keys and tensor names llama.cpp's converter gives a Qwen3-VL projector (--mmproj, F16
matrices, F32 vectors and position embedding; the same layout as the tiny fixture
tests/data/models/qwen3vl-mmproj-F16.gguf). Speed does not depend on the weight values. mtmd
needs a text model beside the projector whose input width matches (2048 x (1 + 3 deepstack)): a
one-layer random-weight qwen3vl file with the VL-2B text shape and a 4096-token stand-in vocabulary
(bench/qwen3_shapes.py's writer). Both files go to $ECHOSPEC_CACHE/bench/ (default
~/.cache/echospec/bench/) and are kept: about 0.8 GB and 0.1 GB.

The engines are measured ALTERNATELY: every round encodes every size with one engine, then the
other, and the order flips each round. Per size: the median time of each engine over the rounds,
ratio = peer median / our median (ours faster: ratio > 1; the goal is >= 1.3), and the median of
the per-round paired ratios. Our output and the peer's are compared too (cosine per token of the
embeddings; they differ by rounding only).

Usage:
    python bench/vision_bench.py                         # 448 and 896, 2 threads, 3 rounds, a table
    python bench/vision_bench.py --json                  # one JSON object on stdout
    python bench/vision_bench.py --threads 2 --rounds 5 --sizes 448,896
    python bench/vision_bench.py --simd avx2             # our AVX2 path, compiled for this run
    python bench/vision_bench.py --no-peer --sizes 448   # ours only (no llama-cpp-python needed)

JSON keys: sizes ("448" -> ours_ms, peer_ms, ratio, paired_ratio, ours_rounds_ms, peer_rounds_ms,
n_tokens, min_cosine), goal, threads, rounds, simd (what the engine reports), simd_build, host_isa,
load_avg (before and after), projector, text_model, peer_error (why the peer is absent).
Progress goes to stderr. Exit status: 0; 2 when a file cannot be written or an engine is unusable.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import engine_bench  # noqa: E402  (bench/: engine builds, host ISA)
import qwen3_shapes  # noqa: E402  (bench/: the text model writer)

GOAL = 1.3      # our encode >= 1.3x llama.cpp's at 448 and 896
# Qwen3-VL-2B-Instruct's vision_config
VISION = dict(hidden=1024, depth=24, heads=16, ffn=4096, patch=16, merge=2, out=2048,
              deepstack=(5, 11, 17), n_pos=2304)
TEXT = qwen3_shapes.Shape("VL-2B-L1", n_embd=2048, n_ff=6144, n_layer=1, n_head=16, n_vocab=4096,
                          stem="qwen3vl-2B-L1", **qwen3_shapes._VL)


class BenchError(RuntimeError):
    """A setup problem the user must fix; exit 2."""


def log(msg: str) -> None:
    print(f"[vision_bench] {msg}", file=sys.stderr, flush=True)


# ---- the files ---------------------------------------------------------------------------------

def projector_tensors(cfg: dict, rng: np.random.Generator):
    """(name, array) of every projector tensor, numpy shapes (the reverse of ggml's ne): matrices
    F16 N(0, 0.7 / sqrt(n_in)), norms 1 + 0.1 N(0, 1), biases 0.02 N(0, 1), position embedding
    0.02 N(0, 1) F32, patch kernel halves F16 [D, 3, P, P]."""
    D, F, P, M2 = cfg["hidden"], cfg["ffn"], cfg["patch"], cfg["merge"] ** 2

    def mat(n_out: int, n_in: int) -> np.ndarray:
        a = rng.standard_normal((n_out, n_in), dtype=np.float32)
        a *= np.float32(0.7 / np.sqrt(n_in))
        return a.astype(np.float16)

    def vec(n: int, norm: bool = False) -> np.ndarray:
        v = rng.standard_normal(n, dtype=np.float32)
        return (1.0 + 0.1 * v if norm else 0.02 * v).astype(np.float32)

    k = 3 * P * P
    for half in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        yield half, mat(D, k).reshape(D, 3, P, P)
    yield "v.patch_embd.bias", vec(D)
    yield "v.position_embd.weight", (0.02 * rng.standard_normal((cfg["n_pos"], D), dtype=np.float32))
    for i in range(cfg["depth"]):
        p = f"v.blk.{i}."
        for ln in ("ln1", "ln2"):
            yield p + ln + ".weight", vec(D, True)
            yield p + ln + ".bias", vec(D)
        for name, n_out, n_in in (("attn_qkv", 3 * D, D), ("attn_out", D, D), ("ffn_up", F, D),
                                  ("ffn_down", D, F)):
            yield p + name + ".weight", mat(n_out, n_in)
            yield p + name + ".bias", vec(n_out)
    yield "v.post_ln.weight", vec(D, True)
    yield "v.post_ln.bias", vec(D)
    for name, n_out, n_in in (("mm.0", D * M2, D * M2), ("mm.2", cfg["out"], D * M2)):
        yield name + ".weight", mat(n_out, n_in)
        yield name + ".bias", vec(n_out)
    for layer in cfg["deepstack"]:
        p = f"v.deepstack.{layer}."
        yield p + "norm.weight", vec(D * M2, True)
        yield p + "norm.bias", vec(D * M2)
        for name, n_out, n_in in (("fc1", D * M2, D * M2), ("fc2", cfg["out"], D * M2)):
            yield p + name + ".weight", mat(n_out, n_in)
            yield p + name + ".bias", vec(n_out)


def write_projector(path: Path, cfg: dict, seed: int = 0) -> None:
    """A Qwen3-VL projector GGUF with random weights: the keys llama.cpp's converter writes
    (general.architecture "clip", clip.projector_type "qwen3vl_merger", clip.vision.*)."""
    import gguf

    side = int(round(cfg["n_pos"] ** 0.5))
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type("mmproj")
    w.add_name("qwen3vl-2B-vision-shape (random weights)")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(cfg["out"])
    w.add_vision_image_size(side * cfg["patch"])
    w.add_vision_patch_size(cfg["patch"])
    w.add_vision_embedding_length(cfg["hidden"])
    w.add_vision_feed_forward_length(cfg["ffn"])
    w.add_vision_block_count(cfg["depth"])
    w.add_vision_head_count(cfg["heads"])
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_clip_projector_type("qwen3vl_merger")
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(cfg["merge"])
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_is_deepstack_layers([i in cfg["deepstack"] for i in range(cfg["depth"])])
    rng = np.random.default_rng(seed)
    for name, arr in projector_tensors(cfg, rng):
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def ensure_files(directory: Path) -> tuple[Path, Path]:
    """The projector and the one-layer text model, written when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    proj = directory / "qwen3vl-2B-vision-shape.mmproj-F16.gguf"
    text = qwen3_shapes.shape_path(TEXT, "F16", directory)
    try:
        if not proj.exists():
            log(f"writing {proj} (random weights, about 0.8 GB, a minute)")
            write_projector(proj, VISION)
        if not text.exists():
            log(f"writing {text} (one layer, random weights)")
            part = text.with_suffix(".part")
            qwen3_shapes.write_f16(TEXT, part)
            part.rename(text)
    except ImportError as e:
        raise BenchError(f"writing the benchmark files needs the gguf package ({e})") from e
    return proj, text


# ---- the engines -------------------------------------------------------------------------------

def test_image(size: int, seed: int) -> np.ndarray:
    """A smooth pseudo-random RGB image [size, size, 3] uint8 (gradients plus noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    base = np.stack([y, x, 1 - (x + y) / 2], -1) * 200
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


class Ours:
    """es_vision_encode on pixels normalised with the projector's mean and std."""

    def __init__(self, path: Path, threads: int):
        from echospec.services.verifier.engine import Vision
        self.v = Vision(str(path))
        self.threads = threads
        self.px: dict[int, np.ndarray] = {}

    def prepare(self, size: int, image: np.ndarray) -> int:
        mean = np.array(self.v.info.image_mean, np.float32)
        std = np.array(self.v.info.image_std, np.float32)
        self.px[size] = np.ascontiguousarray(((image.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1))
        return (size // self.v.info.side) ** 2

    def encode(self, size: int) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        embd, _ = self.v.encode(self.px[size], self.threads)
        return (time.perf_counter() - t0) * 1e3, embd

    def close(self) -> None:
        self.v.close()


class Peer:
    """llama.cpp's mtmd (llama-cpp-python): the image chunk of a tokenized prompt, mtmd_encode_chunk."""

    def __init__(self, proj: Path, text: Path, threads: int):
        import ctypes
        try:
            import llama_cpp
            from llama_cpp import mtmd_cpp as M
        except ImportError as e:
            raise BenchError(f"llama-cpp-python with mtmd is not installed ({e}); "
                             "pip install -e .[bench], or --no-peer") from e
        self.ct, self.L, self.M = ctypes, llama_cpp, M
        qwen3_shapes.quiet_llama_cpp()
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(text).encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise BenchError(f"llama.cpp could not load {text}")
        cp = M.mtmd_context_params_default()
        cp.use_gpu, cp.n_threads, cp.print_timings, cp.warmup = False, threads, False, False
        self.ctx = M.mtmd_init_from_file(str(proj).encode(), self.model, cp)
        if not self.ctx:
            raise BenchError(f"mtmd could not load {proj}")
        self.width = llama_cpp.llama_model_n_embd_inp(self.model)
        self.chunks: dict[int, tuple] = {}

    def prepare(self, size: int, image: np.ndarray) -> int:
        ct, M = self.ct, self.M
        img = np.ascontiguousarray(image)
        bm = M.mtmd_bitmap_init(size, size, img.ctypes.data_as(ct.POINTER(ct.c_uint8)))
        chunks = M.mtmd_input_chunks_init()
        text = b"a " + M.mtmd_default_marker() + b" b"
        inp = M.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), False, True
        if M.mtmd_tokenize(self.ctx, chunks, ct.byref(inp), (M.mtmd_bitmap_p_ctypes * 1)(bm), 1) != 0:
            raise BenchError(f"mtmd could not tokenize the {size}x{size} image")
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                self.chunks[size] = (chunks, bm, ch)
                return M.mtmd_input_chunk_get_n_tokens(ch)
        raise BenchError("mtmd made no image chunk")

    def encode(self, size: int) -> tuple[float, np.ndarray]:
        ct, M = self.ct, self.M
        ch = self.chunks[size][2]
        t0 = time.perf_counter()
        if M.mtmd_encode_chunk(self.ctx, ch) != 0:
            raise BenchError("mtmd_encode_chunk failed")
        ms = (time.perf_counter() - t0) * 1e3
        n = M.mtmd_input_chunk_get_n_tokens(ch)
        p = ct.cast(M.mtmd_get_output_embd(self.ctx), ct.POINTER(ct.c_float))
        out = np.ctypeslib.as_array(p, shape=(n * self.width,)).reshape(n, self.width)
        return ms, out[:, :VISION["out"]].copy()

    def close(self) -> None:
        for chunks, bm, _ in self.chunks.values():
            self.M.mtmd_input_chunks_free(chunks)
            self.M.mtmd_bitmap_free(bm)
        self.M.mtmd_free(self.ctx)
        self.L.llama_model_free(self.model)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min())


# ---- the run -------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    proj, text = ensure_files(Path(args.dir) if args.dir else qwen3_shapes.out_dir())
    load_before = os.getloadavg()
    ours = Ours(proj, args.threads)
    from echospec.services.verifier.engine import simd_name
    simd = simd_name()
    peer, peer_error = None, None
    if not args.no_peer:
        try:
            peer = Peer(proj, text, args.threads)
        except BenchError as e:
            peer_error = str(e)
            log(f"peer unavailable: {e}")
    engines = {"ours": ours, **({"peer": peer} if peer else {})}
    results: dict = {}
    outputs: dict = {}
    for size in args.sizes:
        image = test_image(size, seed=size)
        for name, eng in engines.items():
            n = eng.prepare(size, image)
            results.setdefault(size, {"n_tokens": {}})["n_tokens"][name] = n
            ms, out = eng.encode(size)      # untimed warm-up
            outputs[(name, size)] = out
            log(f"{name} {size}x{size}: {n} image tokens, warm-up {ms:.0f} ms")
    times = {(name, size): [] for name in engines for size in args.sizes}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            for size in args.sizes:
                ms, _ = engines[name].encode(size)
                times[(name, size)].append(ms)
                log(f"round {r + 1}/{args.rounds} {name} {size}x{size}: {ms:.0f} ms")
    out = {"sizes": {}, "goal": GOAL, "threads": args.threads, "rounds": args.rounds,
           "simd": simd, "simd_build": args.simd, "host_isa": engine_bench.host_isa(),
           "load_avg": {"before": [round(x, 2) for x in load_before],
                        "after": [round(x, 2) for x in os.getloadavg()]},
           "projector": str(proj), "text_model": str(text), "peer_error": peer_error}
    for size in args.sizes:
        o = times[("ours", size)]
        row = {"ours_ms": statistics.median(o), "ours_rounds_ms": [round(x, 1) for x in o],
               "n_tokens": results[size]["n_tokens"]}
        if peer:
            p = times[("peer", size)]
            row.update(peer_ms=statistics.median(p), peer_rounds_ms=[round(x, 1) for x in p],
                       ratio=statistics.median(p) / statistics.median(o),
                       paired_ratio=statistics.median(b / a for a, b in zip(o, p)))
            a, b = outputs[("ours", size)], outputs[("peer", size)]
            row["min_cosine"] = min_cosine(a, b) if a.shape == b.shape else None
        out["sizes"][str(size)] = row
    ours.close()
    if peer:
        peer.close()
    return out


def print_table(res: dict) -> None:
    print(f"vision encode, Qwen3-VL-2B projector shape, {res['threads']} threads, {res['rounds']} rounds, "
          f"ours {res['simd'] or res['simd_build']} on {res['host_isa']}, load {res['load_avg']['before'][0]}"
          f" -> {res['load_avg']['after'][0]}")
    print(f"{'size':>9} {'tokens':>7} {'ours ms':>9} {'llama.cpp ms':>13} {'ratio':>6} {'paired':>7} {'min cos':>8}")
    for size, r in res["sizes"].items():
        peer = r.get("peer_ms")
        print(f"{size + 'x' + size:>9} {r['n_tokens']['ours']:>7} {r['ours_ms']:>9.0f} "
              + (f"{peer:>13.0f} {r['ratio']:>6.2f} {r['paired_ratio']:>7.2f} "
                 f"{r['min_cosine'] if r['min_cosine'] is None else round(r['min_cosine'], 5)!s:>8}"
                 if peer else f"{'-':>13} {'-':>6} {'-':>7} {'-':>8}"))
    if res["peer_error"]:
        print(f"peer: {res['peer_error']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and size (default 3)")
    ap.add_argument("--sizes", default="448,896", help="square image sides, multiples of 32 (default 448,896)")
    ap.add_argument("--simd", default="installed", choices=engine_bench.SIMD_BUILDS,
                    help="our engine build (as engine_bench.py --simd)")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--dir", help="where the benchmark files are kept (default $ECHOSPEC_CACHE/bench)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    try:
        a.sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: not a list of integers: {a.sizes!r}")
    if not a.sizes or any(s < 32 or s % 32 for s in a.sizes):
        ap.error("--sizes: every side must be a positive multiple of 32")
    if a.threads < 1 or a.rounds < 1:
        ap.error("--threads and --rounds must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.simd != "installed":
            tmp = tempfile.mkdtemp(prefix="vision-bench-engine-")
            engine_bench.use_engine_module(engine_bench.build_engine_module(args.simd, Path(tmp)))
        res = run(args)
    except (BenchError, engine_bench.BenchError) as e:
        print(f"vision_bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
